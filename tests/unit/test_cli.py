"""The ``tide`` command as an operator scripts it: cheap help, a version, options after the verb,
errors on stderr with a non-zero exit, and the running stack's control token."""
import subprocess
import sys

import pytest
import yaml

from tide.cli import main


def test_help_loads_neither_torch_nor_mlflow():
    code = ("import sys\nfrom tide.cli import main\n"
            "for argv in (['--help'], ['drafters', '--help'], ['data', 'stats', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
            "print(sorted(m for m in ('torch', 'mlflow', 'transformers', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("tide ")


def test_home_after_the_verb_is_honoured(tmp_path, capsys):
    home = tmp_path / "elsewhere"
    assert main(["data", "stats", "--home", str(home)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"no dataset at {home / 'dataset'}" in err


def test_token_of_a_running_stack(tmp_path, capsys):
    home = tmp_path / "home"
    assert main(["--home", str(home), "token"]) == 2
    assert "no running `tide up` config" in capsys.readouterr().err
    (home / "run").mkdir(parents=True)
    (home / "run" / "tide.yaml").write_text(yaml.safe_dump({"server": {"control_token": "s3cret"}}))
    assert main(["token", "--home", str(home)]) == 0
    assert capsys.readouterr().out.strip() == "s3cret"


@pytest.mark.parametrize("verb", ["serve", "ingest", "scheduler"])
def test_service_verbs_start_the_packaged_services(tmp_path, verb, capsys):
    """``tide serve|ingest|scheduler`` run tide/services/*: a missing config file exits 2 (before torch)."""
    assert main([verb, "--config", str(tmp_path / "missing.yaml")]) == 2


@pytest.mark.parametrize("verb,flags,module", [
    ("serve", ["--port", "8123", "--host", "127.0.0.1", "--bootstrap-servers", "h:1"], "engine"),
    ("ingest", ["--data-dir", "/tmp/x", "--bootstrap-servers", "h:1"], "ingest"),
    ("scheduler", ["--data-dir", "/tmp/x", "--log-level", "WARNING"], "scheduler"),
])
def test_service_verbs_pass_the_services_own_flags(tmp_path, verb, flags, module, capsys):
    """Flags after the verb reach the service's parser: it accepts its own, refuses others, answers --help."""
    assert main([verb, *flags, "--config", str(tmp_path / "missing.yaml")]) == 2  # parsed; the config is missing
    with pytest.raises(SystemExit) as exc:
        main([verb, "--no-such-flag"])
    assert exc.value.code == 2
    assert f"python -m tide.services.{module}: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([verb, "--help"])
    assert exc.value.code == 0 and f"usage: python -m tide.services.{module}" in capsys.readouterr().out


def test_other_verbs_still_refuse_unknown_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["token", "--port", "1"])
    assert exc.value.code == 2 and "unrecognized arguments: --port 1" in capsys.readouterr().err
