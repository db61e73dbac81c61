"""The daemon's coordinator and memory-tier options: one-line errors naming the key, and what they resolve to."""

from __future__ import annotations

import pytest

from trainguard.agent.config import AgentConfig, AgentConfigError


@pytest.mark.parametrize("text, needle", [
    ('[coordinator]\naddresses = ["h:1", "nohost"]\n', "coordinator.addresses[1]: 'nohost' is not HOST:PORT"),
    ('[coordinator]\naddresses = "h:1"\n', "coordinator.addresses: expected an array"),
    # a listener's "any port" names no coordinator: every report failed as "unreachable"
    ('[coordinator]\naddress = "10.0.0.1:0"\n', "coordinator.address: '10.0.0.1:0' has port 0; give the port"),
    ('[coordinator]\naddresses = ["h:1", "h:0"]\n', "coordinator.addresses[1]: 'h:0' has port 0"),
    ('[coordinator]\njob = "a b"\n', "coordinator.job: 'a b' is not a job name"),
    ('[coordinator]\ntoken_file = "/nonexistent/token"\n', "coordinator.token_file: cannot read the job token"),
    ('[memory_tier]\nroot = "shm"\n', "memory_tier.root: 'shm' must be an absolute path"),
    ('[memory_tier]\nttl_s = -1\n', "memory_tier.ttl_s: -1.0 is outside [0, 2592000] seconds"),
    ('[memory_tier]\nkeep = 2\n', "unknown key 'keep' in [memory_tier]"),
    ('[predictor]\ninterval_s = nan\n', "predictor.interval_s: expected a finite number (nan is not allowed"),
    ('[predictor]\ninterval_s = inf\n', "predictor.interval_s: expected a finite number (inf is not allowed"),
    ('[predictor]\ninterval_s = 0\n', "predictor.interval_s: 0.0 is outside [0.1, 3600] seconds"),
    ('[predictor]\ninterval_s = "5s"\n', "predictor.interval_s"),
])
def test_bad_option_is_one_line_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "agent.toml"
    path.write_text(text)
    with pytest.raises(AgentConfigError) as err:
        AgentConfig.load(path, env={})
    assert needle in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_targets_merge_address_and_addresses_and_short_token_is_refused(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text('[coordinator]\naddress = "a:1"\naddresses = ["b:2", "a:1"]\n')
    assert AgentConfig.load(path, env={}).coordinator.targets() == ["a:1", "b:2"]
    token = tmp_path / "token"
    token.write_text("short\n")
    path.write_text(f'[coordinator]\naddress = "a:1"\ntoken_file = "{token}"\n')
    with pytest.raises(AgentConfigError, match="coordinator.token_file: the job token has 5 characters"):
        AgentConfig.load(path, env={})


def test_a_bad_detector_table_is_named_as_the_file_names_it(tmp_path):
    """In agent.toml a detector's table is [detectors.pcie]; the error said [pcie], a table the file has not."""
    from trainguard.detectors.errors import DetectorConfigError

    path = tmp_path / "agent.toml"
    path.write_text('[detectors]\nenabled = ["pcie"]\n[detectors.pcie]\ninterval_s = -5\n')
    with pytest.raises(DetectorConfigError, match=r"\[detectors\.pcie\]: interval_s=-5\.0 must be > 0"):
        AgentConfig.load(path, env={}).detector_loader()


@pytest.mark.parametrize("node_id", ["gpu node 1", "rack/3", "-n1", "n" * 129])
def test_a_node_id_coordinators_refuse_is_refused_at_start(tmp_path, node_id):
    """The daemon started with such a node id and every report was refused by every coordinator (logged as
    "unreachable"); the rule is the coordinators' own."""
    from trainguard.agent.config import NODE_ID_RE
    from trainguard.recovery import service

    assert NODE_ID_RE is service.NODE_ID_RE  # one rule, trainguard.names
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nnode_id = "{node_id}"\n')
    with pytest.raises(AgentConfigError, match="agent.node_id: .* is not a node id"):
        AgentConfig.load(path, env={})
