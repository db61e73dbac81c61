"""The agent's TOML configuration: defaults, the shipped example, type and key checks, env overrides."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trainguard.agent import config as cfg
from trainguard.agent.config import AgentConfig, AgentConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "agent.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid_and_missing_default_file_is_allowed(tmp_path):
    c = AgentConfig.load(None, env={cfg.CONFIG_ENV: ""})  # /etc/trainguard/agent.toml is absent here
    assert c.grpc.socket == "/run/trainguard/agent.sock"
    assert c.grpc.socket_mode == 0o660


def test_shipped_example_loads_and_documents_every_option():
    c = AgentConfig.load(EXAMPLE, env={})
    text = EXAMPLE.read_text()
    for section in dataclasses.fields(AgentConfig):
        if section.name in ("source", "origins"):
            continue
        assert f"[{section.name}]" in text
        body = text.split(f"[{section.name}]", 1)[1].split("\n[", 1)[0]
        for f in dataclasses.fields(getattr(c, section.name)):
            if (section.name, f.name) == ("detectors", "settings"):
                assert "# settings: one optional table per detector, [detectors.<name>]" in body
                continue
            assert re.search(rf"^#? ?{f.name} = ", body, re.M), f"{section.name}.{f.name} is not documented"
    # Every environment override is documented too.
    for var in [cfg.CONFIG_ENV, *cfg.ENV_OVERRIDES]:
        assert var in text


def test_example_values_equal_the_defaults():
    assert AgentConfig.load(EXAMPLE, env={}) == AgentConfig(source="x")


@pytest.mark.parametrize(
    "text, needle",
    [
        ("[grpc]\nlisten = 7350\n", "grpc.listen: expected a string, got an integer 7350"),
        ("[grpc]\nmax_workers = \"8\"\n", "grpc.max_workers: expected an integer"),
        ("[tls]\nenabled = 1\n", "tls.enabled: expected a boolean"),
        ("[detectors]\nenabled = \"all\"\n", "detectors.enabled: expected an array"),
        ("[grpc]\nlisten_addr = \"x\"\n", "unknown key 'listen_addr' in [grpc]"),
        ("[gprc]\nlisten = \"x\"\n", "unknown table [gprc]"),
        ("grpc = 3\n", "grpc: expected a table [grpc] of listen, socket"),
        ("[grpc]\nlisten = \"localhost\"\n", "grpc.listen: 'localhost' is not HOST:PORT"),
        ("[grpc]\nlisten = \"h:99999\"\n", "port must be a number in 0-65535"),
        ("[grpc]\nsocket_mode = 0o666\n", "grants access to every user"),
        ("[grpc]\nsocket = \"/" + "x" * 120 + "\"\n", "over the 107-byte unix limit"),
        ("[predictor]\nthreshold = 1.5\n", "predictor.threshold: 1.5 is outside [0, 1]"),
        ("[tls]\nenabled = true\n", "tls.cert_file: required"),
        ("[tls]\nclient_ca_file = \"/etc/hostname\"\n", "mutual TLS needs TLS"),
        ("[log]\nformat = \"xml\"\n", "log.format: 'xml' is not one of"),
        ("[grpc\n", "not valid TOML"),
        ("[grpc]\nlisten = \"127.0.0.1:29631\"\n[metrics]\nlisten = \"0.0.0.0:29631\"\n",
         "metrics.listen: 0.0.0.0:29631 and grpc.listen (127.0.0.1:29631) are the same port"),
        # '~' in the file was a folder named '~' (or, for detectors.root, every detector read nothing).
        ("[detectors]\nroot = \"~/fake-sys\"\n", "detectors.root: '~/fake-sys' starts with '~', which only a shell"),
        ("[agent]\nstate_dir = \"~/st\"\n", "agent.state_dir: '~/st' starts with '~'"),
        ("[coordinator]\njob_tls_dirs = [\"/a\", \"~x/tls\"]\n", "coordinator.job_tls_dirs[1]: '~x/tls' starts"),
    ],
)
def test_bad_config_is_one_line_naming_file_and_key(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(AgentConfigError) as err:
        AgentConfig.load(path, env={})
    message = str(err.value)
    assert needle in message
    assert str(path) in message
    assert "\n" not in message


def test_unreadable_certificate_is_named(tmp_path):
    key = tmp_path / "k.pem"
    key.write_text("x")
    path = write(tmp_path, f'[tls]\nenabled = true\ncert_file = "{tmp_path}/missing.pem"\nkey_file = "{key}"\n')
    with pytest.raises(AgentConfigError, match=r"tls\.cert_file: cannot read .*missing\.pem \(No such file"):
        AgentConfig.load(path, env={})
    directory = tmp_path / "adir"
    directory.mkdir()
    path = write(tmp_path, f'[tls]\nenabled = true\ncert_file = "{key}"\nkey_file = "{directory}"\n')
    with pytest.raises(AgentConfigError, match=r"tls\.key_file: cannot read .*adir \(Is a directory\)"):
        AgentConfig.load(path, env={})


def test_per_detector_tables(tmp_path):
    path = write(tmp_path, '[detectors]\nenabled = ["all"]\ninterval_s = 2\n[detectors.roce]\ninterval_s = 0.5\n')
    c = AgentConfig.load(path, env={})
    assert c.detectors.settings == {"roce": {"interval_s": 0.5}}
    settings = c.detector_settings()
    assert settings["roce"] == {"interval_s": 0.5} and settings["host"] == {"interval_s": 2.0}
    path = write(tmp_path, '[detectors]\nenabled = ["roce"]\n[detectors.kmsg]\nx = 1\n')
    with pytest.raises(AgentConfigError, match=r"detectors\.kmsg: settings for a detector that is not in"):
        AgentConfig.load(path, env={})


def test_missing_explicit_file_is_an_error(tmp_path):
    with pytest.raises(AgentConfigError, match="config file not found"):
        AgentConfig.load(tmp_path / "nope.toml", env={})


def test_env_overrides_file_and_are_typed(tmp_path):
    path = write(tmp_path, '[grpc]\nlisten = "127.0.0.1:1"\n[log]\nlevel = "debug"\n')
    c = AgentConfig.load(path, env={cfg.GRPC_LISTEN_ENV: "127.0.0.1:2", cfg.DETECTORS_ROOT_ENV: "/fake",
                                     cfg.SOCKET_ENV: ""})
    assert c.grpc.listen == "127.0.0.1:2"
    assert c.detectors.root == "/fake"
    assert c.grpc.socket == ""
    assert c.log.level == "debug"
    with pytest.raises(AgentConfigError, match=rf"metrics\.listen \(set by \${cfg.METRICS_LISTEN_ENV}\).*port must be"):
        AgentConfig.load(path, env={cfg.METRICS_LISTEN_ENV: "127.0.0.1:x"})
    # The config path itself can come from the environment.
    assert AgentConfig.load(None, env={cfg.CONFIG_ENV: str(path)}).grpc.listen == "127.0.0.1:1"


def test_restart_required_names_non_reloadable_changes():
    old = AgentConfig(source="a")
    new = old.with_overrides({("log", "level"): "debug", ("grpc", "listen"): "127.0.0.1:1",
                              ("predictor", "threshold"): 0.9})
    assert old.restart_required(new) == ["grpc.listen"]
    assert old.log.level == "info"  # overrides copy, never mutate


def test_parse_hostport_ipv6():
    assert cfg.parse_hostport("[::1]:7350") == ("::1", 7350)
    with pytest.raises(ValueError, match="brackets"):
        cfg.parse_hostport("::1:7350")


@pytest.mark.parametrize("text, needle", [
    # was: "unknown key 'listen_addr' in [grpc]; known keys: ..." with no suggestion
    ('[grpc]\nlisten_addr = "127.0.0.1:1"\n', "unknown key 'listen_addr' in [grpc]; did you mean 'listen'?"),
    ('[gprc]\nlisten = "127.0.0.1:1"\n', "unknown table [gprc]; did you mean 'grpc'?"),
    # was: "not valid TOML: 'utf-8' codec can't decode byte 0xe9 in position 25: invalid continuation byte"
    (b'[agent]\nstate_dir = "/caf\xe9"\n', "not UTF-8 text (invalid continuation byte at byte 25, line 2)"),
    # was: "not valid TOML: Invalid value (at line 2, column 10)"
    ("[grpc]\nlisten = \n", "not valid TOML at line 2, column 10: Invalid value"),
])
def test_file_problems_name_the_line_or_the_nearest_key(tmp_path, text, needle):
    path = tmp_path / "agent.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(AgentConfigError) as err:
        AgentConfig.load(path, env={})
    assert needle in str(err.value) and str(err.value).startswith(f"{path}: ") and "\n" not in str(err.value)


def test_a_directory_given_as_config_is_named_as_such(tmp_path):
    # was: "cannot read config file (Is a directory); check its permissions"
    with pytest.raises(AgentConfigError, match=r": is a directory; --config takes a TOML file$"):
        AgentConfig.load(tmp_path, env={})


def test_predictor_threshold_nan_still_means_unset_and_settings_is_no_key(tmp_path):
    """The shared loader refuses nan for floats; predictor.threshold allows it (documented: unset)."""
    import math

    path = write(tmp_path, "[predictor]\nthreshold = nan\n")
    assert math.isnan(AgentConfig.load(path, env={}).predictor.threshold)
    path = write(tmp_path, "[detectors]\nsettings = 1\n")  # the per-detector tables fill it, never a key
    with pytest.raises(AgentConfigError, match=r"unknown key 'settings' in \[detectors\]"):
        AgentConfig.load(path, env={})
