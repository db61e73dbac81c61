"""AttachJob's TLS file paths: the root daemon opens a path a launcher names (sent without its PEM contents) only
under ``coordinator.job_tls_dirs``, so no user of its socket can have it present the node's own key, or read a
root-only file as a certificate, to a coordinator of their choosing."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import grpc
import pytest

from agentd_unit import inproc_daemon
from trainguard.agent.arena_keeper import ArenaKeeper
from trainguard.agent.config import AgentConfig, AgentConfigError
from trainguard.agent.coordinator_report import NodeVerdict
from trainguard.agent.daemon_jobs import DaemonJobs, JobTlsPathRefused
from trainguard.proto import agent_pb2
from trainguard.recovery.rpc_security import SecurityConfigError


def _jobs(tmp_path: Path, tls_dirs: tuple[str, ...] = ()) -> DaemonJobs:
    keeper = ArenaKeeper(str(tmp_path / f"shm-{uuid.uuid4().hex[:8]}"), ttl_s=0.0, alive=lambda key: True)
    return DaemonJobs("n", "h", "i", lambda: NodeVerdict(), keeper, 1.0, 1.0, alive=lambda key: True,
                      tls_dirs=tls_dirs)


def _req(**tls: str) -> agent_pb2.AttachJobRequest:
    return agent_pb2.AttachJobRequest(job="j", coordinator="127.0.0.1:1", launcher_pid=1, **tls)


def test_a_path_sent_without_contents_is_refused_by_default(tmp_path: Path) -> None:
    node_key = tmp_path / "node-client.key"  # stands for the daemon's own [coordinator] key, root-only
    node_key.write_text("-----BEGIN PRIVATE KEY-----\n")
    os.chmod(node_key, 0o600)
    jobs = _jobs(tmp_path)
    try:
        for field, path in (("tls_key_file", str(node_key)), ("tls_ca_file", "/etc/shadow")):
            with pytest.raises(JobTlsPathRefused) as refused:
                jobs.attach(_req(**{field: path}))
            line = str(refused.value)
            assert "\n" not in line and line.startswith(f"{field} ")
            assert field.replace("_file", "_pem") in line and "coordinator.job_tls_dirs" in line
        assert jobs.reporters() == []
    finally:
        jobs.stop()


def test_only_paths_resolving_under_the_allowed_folders_are_opened(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "job-tls", tmp_path / "elsewhere"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ca.pem").write_text("not a certificate")
    (outside / "secret").write_text("root only")
    os.symlink(outside / "secret", allowed / "link.pem")  # in an allowed folder, leading out of it
    os.symlink(allowed, tmp_path / "alias")  # outside by name, inside once resolved
    jobs = _jobs(tmp_path, (str(allowed),))
    try:
        with pytest.raises(JobTlsPathRefused, match="tls_ca_file"):
            jobs.attach(_req(tls_ca_file=str(allowed / "link.pem")))
        with pytest.raises(JobTlsPathRefused, match="tls_ca_file"):
            jobs.attach(_req(tls_ca_file=str(allowed / ".." / "elsewhere" / "secret")))
        for path in (allowed / "ca.pem", tmp_path / "alias" / "ca.pem"):
            # Opened (and refused for its contents, not its place).
            with pytest.raises(SecurityConfigError) as read:
                jobs.attach(_req(tls_ca_file=str(path)))
            assert not isinstance(read.value, JobTlsPathRefused) and "ca.pem" in str(read.value)
        # Contents sent: the path is only the launcher's name for them and is never opened.
        with pytest.raises(SecurityConfigError) as sent:
            jobs.attach(_req(tls_ca_file=str(outside / "secret"), tls_ca_pem=b"not a certificate"))
        assert not isinstance(sent.value, JobTlsPathRefused)
    finally:
        jobs.stop()


def test_job_tls_dirs_must_be_absolute(tmp_path: Path) -> None:
    config = AgentConfig.from_mapping({"coordinator": {"job_tls_dirs": ["etc/tls"]}}, "agent.toml")
    with pytest.raises(AgentConfigError, match=r"coordinator.job_tls_dirs\[0\]"):
        config.validate()


def test_attach_job_refuses_a_bare_path_as_an_invalid_argument(tmp_path: Path) -> None:
    with inproc_daemon(tmp_path) as (_, stub):
        with pytest.raises(grpc.RpcError) as refused:
            stub.AttachJob(_req(tls_cert_file="/etc/shadow", tls_key_file="/etc/shadow"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details().startswith("tls_cert_file '/etc/shadow': ")
