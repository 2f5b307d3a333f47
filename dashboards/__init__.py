"""The Grafana dashboard and the Prometheus rules (with their promtool tests), installed as the
package data of ``tide.dashboards`` (pyproject.toml package-dir): ``tide.prometheus.RULES_PATH``."""
