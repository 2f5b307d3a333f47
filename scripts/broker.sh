#!/usr/bin/env bash
# Start/stop a Kafka-protocol broker (tansu) on loopback; see tide/broker.py for the modes.
#   scripts/broker.sh start memory  --port 9092 --state-dir /tmp/tide-broker
#   scripts/broker.sh start durable --port 9092 --state-dir ~/.cache/tide/broker
#   scripts/broker.sh stop --state-dir /tmp/tide-broker
#   scripts/broker.sh run durable --port 9092 --state-dir DIR   # foreground until Ctrl-C / SIGTERM
set -euo pipefail
exec python3 -m tide.broker "$@"
