"""The detector settings of ``trainguard run``: the ``--detector-config`` TOML file and ``--hang-floor-s``.

The file sets where the detectors read the hardware and each detector's own fields::

    # trainguard run --detectors process,pcie,roce --detector-config node.toml ...
    root = "/srv/drill/node3"     # prefix of the /sys, /proc and /dev files the detectors read (default "/")
    interval_s = 1.0              # sampling period of every polled detector, seconds (default 0: each its own)

    [pcie]                        # one table per detector, named as in --detectors; its config class's fields
    aer_scope = "all"

    [roce]
    root = "/"                    # a table's own root wins over the top-level one: real netlink and veths here
    interfaces = ["veth*"]

    [process]
    hang_floor_s = 20.0

The top-level ``root`` applies to every detector except those that watch the workers (``process``): they read
``/proc/<pid>`` of the processes this agent itself started, which exist only in the real ``/proc`` (with a fake
root every worker would look gone and hangs would go unseen); their own table may still set ``root``.

Top-level keys other than ``root`` and ``interval_s`` must be tables named after a detector that ``--detectors``
enables; each table's fields are checked by that detector's own config class (``trainguard detect --help`` lists
the detectors; each detector module documents its fields). ``--hang-floor-s`` sets ``process.hang_floor_s`` unless
the file sets it. The ``host`` detector's ``memory_cgroup`` defaults to ``"self"`` here: the launcher shares the
job's container, whose memory limit the OOM killer enforces (see :mod:`trainguard.detectors.cgroup_memory`).

The file is read by the one detector-settings loader, :class:`~trainguard.detectors.settings.DetectorSettings`
(the daemon's ``[detectors]`` section and ``trainguard detect --config`` use it too). Every problem raises
:class:`~trainguard.agent.config.AgentConfigError` with one line naming the file, the key and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.agent.config import AgentConfigError
from trainguard.errors import UsageError


def run_detector_settings(enabled: Sequence[str], config_path: str | None,
                          hang_floor_s: float | None) -> dict[str, dict[str, Any]]:
    """The ``detector_config`` of a ``trainguard run`` node: its ``--detector-config`` file and flags, validated.

    Args:
        enabled: detector names from ``--detectors``.
        config_path: the ``--detector-config`` file, or None for defaults.
        hang_floor_s: ``--hang-floor-s``, in seconds.

    Returns:
        Detector name -> fields.

    Raises:
        AgentConfigError: the file is unusable or does not fit ``enabled``.
        UsageError: ``enabled`` names an unknown detector.
    """
    from trainguard.detectors.base import detector_class
    from trainguard.detectors.errors import DetectorConfigError
    from trainguard.detectors.settings import DetectorSettings

    for name in enabled:
        try:
            detector_class(name)  # an unknown name fails here, before any process starts
        except DetectorConfigError as exc:
            raise UsageError(f"--detectors {','.join(enabled)}: {exc}") from exc
    try:
        if config_path is None:
            config = DetectorSettings.from_table({}, source="--detectors", enabled=enabled,
                                                 enabled_flag="--detectors")
        else:
            config = DetectorSettings.load(config_path, enabled=enabled, enabled_flag="--detectors")
        out = config.settings(hang_floor_s)
    except DetectorConfigError as exc:
        raise AgentConfigError(str(exc)) from exc
    if "host" in enabled:
        # The launcher runs in the job's container with its workers: the OOM killer acts at that cgroup's limit,
        # whatever /proc/meminfo says of the host. The node daemon keeps the node's figures (its own cgroup is not
        # the job's); a --detector-config [host] memory_cgroup wins.
        out.setdefault("host", {}).setdefault("memory_cgroup", "self")
    return out
