"""A node's hardware as sysfs and procfs show it, in a folder: for tests and drills on machines without it.

Every detector reads its files under a configurable ``root`` (``trainguard run --detector-config`` with
``root = <folder>``, the daemon's ``detectors.root``), so the real detectors and the real predictor run unchanged
on a tree these functions write. Each writer produces the kernel's own file formats:

- PCIe (:func:`write_pci_device`, :class:`FakeNodeHardware`): ``/sys/bus/pci/devices/<bdf>``, a symlink into
  ``/sys/devices/pci<dom>:<bus>/...``, with the AER counter tables (``aer_dev_correctable``, ``aer_dev_nonfatal``,
  ``aer_dev_fatal``: one ``<name> <count>`` line per error bit, then a ``TOTAL_ERR_*`` line, as
  ``drivers/pci/pcie/aer.c`` prints them since Linux 5.x; :data:`AER_CORRECTABLE_4_19` for the older names) and
  the link files (``current_link_width`` / ``max_link_width``, ``current_link_speed`` / ``max_link_speed``);
- thermal zones (:func:`write_thermal_zone`), EDAC memory controllers (:func:`write_edac_mc`), RDMA ports and
  their netdev statistics (:func:`write_rdma_port`), and any other file (:func:`write_file`).

Every write goes to a temporary file renamed over the old one, so a detector polling the tree never reads half a
table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Correctable AER bit names as Linux >= 5.x prints them.
AER_CORRECTABLE = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
#: The same bits as the 4.19 ABI document's sample names them (with spaces).
AER_CORRECTABLE_4_19 = ("Receiver Error", "Bad TLP", "Bad DLLP", "RELAY_NUM Rollover", "Replay Timer Timeout",
                        "Advisory Non-Fatal", "Corrected Internal Error", "Header Log Overflow")
#: Uncorrectable AER bit names (the nonfatal and fatal tables).
AER_UNCORRECTABLE = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
                     "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked",
                     "TLPBlockedErr", "PoisonTLPBlocked")

#: The root port and the GPU of :class:`FakeNodeHardware` (and the default device of :func:`write_gpu`).
ROOT_PORT = "0000:00:03.0"
GPU = "0000:3b:00.0"


def write_file(root: str | os.PathLike, rel: str, text: str) -> Path:
    """Atomically (re)writes ``<root>/<rel>``, creating its folders; returns its path."""
    path = Path(root) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def aer_table(names: Sequence[str], total_key: str, counts: Mapping[str, int] | None = None) -> str:
    """An AER counter table as sysfs prints it: ``<name> <count>`` per bit, then ``<total_key> <sum>``."""
    counts = counts or {}
    lines = [f"{n} {counts.get(n, 0)}" for n in names]
    return "\n".join(lines + [f"{total_key} {sum(counts.values())}"]) + "\n"


def write_pci_device(root: str | os.PathLike, bdf: str, cls: str = "0x030200", above: str = "",
                     cor: Mapping[str, int] | None = None, nonfatal: Mapping[str, int] | None = None,
                     fatal: Mapping[str, int] | None = None, width: int = 16, max_width: int = 16,
                     speed: str = "32.0 GT/s PCIe", max_speed: str = "32.0 GT/s PCIe",
                     cor_names: Sequence[str] = AER_CORRECTABLE) -> Path:
    """(Re)writes one PCI function as sysfs shows it under ``root``.

    Args:
        root: the folder standing for ``/``.
        bdf: PCI address (``0000:3b:00.0``).
        cls: PCI class (``0x030200`` 3D controller, ``0x060400`` PCI bridge / root port).
        above: the chain of ports above it (``"0000:00:03.0"``, or ``"a/b"``), as directories under
            ``pci0000:00``.
        cor, nonfatal, fatal: AER error name -> count (kernel names, e.g. ``"DLP"``).
        width, max_width: current and maximum link width (lanes).
        speed, max_speed: current and maximum link speed, as sysfs prints them.
        cor_names: the correctable table's bit names (:data:`AER_CORRECTABLE_4_19` for the older kernels').

    Returns:
        The device's directory (``/sys/devices/pci0000:00/<above>/<bdf>`` under ``root``).
    """
    d = Path(root) / "sys/devices/pci0000:00" / above / bdf
    d.mkdir(parents=True, exist_ok=True)
    link = Path(root) / "sys/bus/pci/devices" / bdf
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        # relative, as the kernel's own (../../../devices/...): a target written as given broke every link of a
        # tree made under a relative root (FakeNodeHardware("hw")), and an absolute one a tree copied elsewhere
        link.symlink_to(os.path.relpath(d, link.parent))
    write_file(d, "class", cls + "\n")
    write_file(d, "aer_dev_correctable", aer_table(cor_names, "TOTAL_ERR_COR", cor))
    write_file(d, "aer_dev_nonfatal", aer_table(AER_UNCORRECTABLE, "TOTAL_ERR_NONFATAL", nonfatal))
    write_file(d, "aer_dev_fatal", aer_table(AER_UNCORRECTABLE, "TOTAL_ERR_FATAL", fatal))
    for name, value in (("current_link_width", str(width)), ("max_link_width", str(max_width)),
                        ("current_link_speed", speed), ("max_link_speed", max_speed)):
        write_file(d, name, value + "\n")
    return d


def write_gpu(root: str | os.PathLike, fatal: Mapping[str, int] | None = None,
              nonfatal: Mapping[str, int] | None = None, width: int = 16) -> Path:
    """(Re)writes the GPU :data:`GPU` directly below the root complex under ``root``; returns its directory."""
    return write_pci_device(root, GPU, fatal=fatal, nonfatal=nonfatal, width=width)


class FakeNodeHardware:
    """One root port and one GPU (x16, 32 GT/s) under ``root``, healthy until a fault is written.

    The faults a real node would show, for drills and tests:

    - :meth:`narrow_link`: the GPU's link retrains at a lower width, a classic precursor (a failing riser or
      connector) the predictor's rules tier turns into a drain before the device is lost;
    - :meth:`aer_fatal`: an uncorrectable fatal AER error (the device or its link failed).
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._fatal: dict[str, int] = {}
        write_pci_device(self.root, ROOT_PORT, cls="0x060400")
        self._gpu = write_pci_device(self.root, GPU, above=ROOT_PORT)

    def narrow_link(self, width: int = 4) -> None:
        """The GPU's link retrains at ``width`` lanes (of 16): a precursor of the device's loss."""
        write_file(self._gpu, "current_link_width", f"{width}\n")

    def aer_fatal(self, bit: str = "DLP") -> None:
        """The GPU reports one more uncorrectable fatal AER error (``bit``: a name of the kernel's table)."""
        self._fatal[bit] = self._fatal.get(bit, 0) + 1
        write_file(self._gpu, "aer_dev_fatal", aer_table(AER_UNCORRECTABLE, "TOTAL_ERR_FATAL", self._fatal))


def write_thermal_zone(root: str | os.PathLike, n: int, temp_mc: int, trips: Mapping[str, int],
                       ztype: str = "x86_pkg_temp") -> None:
    """``/sys/class/thermal/thermal_zone<n>``: its type, temperature and trip points (millidegrees Celsius).

    Args:
        trips: trip kind (``passive``, ``hot``, ``critical``) -> temperature, numbered in order.
    """
    z = f"sys/class/thermal/thermal_zone{n}"
    write_file(root, f"{z}/type", ztype + "\n")
    write_file(root, f"{z}/temp", f"{temp_mc}\n")
    for i, (kind, t) in enumerate(trips.items()):
        write_file(root, f"{z}/trip_point_{i}_type", kind + "\n")
        write_file(root, f"{z}/trip_point_{i}_temp", f"{t}\n")


def write_edac_mc(root: str | os.PathLike, n: int, ce: int, ue: int,
                  dimms: Sequence[tuple[int, int]] = ((0, 0),)) -> None:
    """``/sys/devices/system/edac/mc/mc<n>``: corrected (``ce``) and uncorrected (``ue``) error counts, and per
    DIMM ``(ce, ue)`` counts with labels as the kernel's EDAC drivers write them."""
    base = f"sys/devices/system/edac/mc/mc{n}"
    write_file(root, f"{base}/ce_count", f"{ce}\n")
    write_file(root, f"{base}/ue_count", f"{ue}\n")
    write_file(root, f"{base}/ce_noinfo_count", "0\n")
    write_file(root, f"{base}/mc_name", "Skylake Socket#0 IMC#0\n")
    for i, (dce, due) in enumerate(dimms):
        write_file(root, f"{base}/dimm{i}/dimm_ce_count", f"{dce}\n")
        write_file(root, f"{base}/dimm{i}/dimm_ue_count", f"{due}\n")
        write_file(root, f"{base}/dimm{i}/dimm_label", f"CPU_SrcID#0_MC#{n}_Chan#{i}_DIMM#0\n")


def write_rdma_port(root: str | os.PathLike, *, device: str = "mlx5_0", port: int = 1,
                    netdev: str | None = "ens1f0np0", state: str = "4: ACTIVE", symbol: int = 0, link_downed: int = 0,
                    oos: int = 0, ack_timeout: int = 0, cnp: int = 0, rx_crc: int = 0) -> None:
    """An RDMA port (``/sys/class/infiniband/<device>/ports/<port>``: state, rate, ``counters``,
    ``hw_counters``) and its Ethernet netdev's ``statistics``, as a RoCE NIC shows them.

    Args:
        netdev: the Ethernet netdev behind the port; None writes none (the RoCE detector then never asks
            netlink for its link, which keeps a test without a listener fast).
        state: the port's ``state`` line (``"4: ACTIVE"``, ``"1: DOWN"``).
        symbol, link_downed: ``counters/symbol_error`` and ``counters/link_downed``.
        oos, ack_timeout, cnp: ``hw_counters/out_of_sequence``, ``local_ack_timeout_err``, ``rp_cnp_handled``.
        rx_crc: the netdev's ``statistics/rx_crc_errors``.
    """
    base = f"sys/class/infiniband/{device}/ports/{port}"
    write_file(root, f"{base}/state", state + "\n")
    write_file(root, f"{base}/phys_state", "5: LinkUp\n")
    write_file(root, f"{base}/link_layer", "Ethernet\n")
    write_file(root, f"{base}/rate", "200 Gb/sec (4X HDR)\n")
    for name, value in (("symbol_error", symbol), ("link_downed", link_downed), ("port_rcv_errors", 0),
                        ("port_xmit_data", 123456789), ("link_error_recovery", 0)):
        write_file(root, f"{base}/counters/{name}", f"{value}\n")
    for name, value in (("out_of_sequence", oos), ("packet_seq_err", 0), ("local_ack_timeout_err", ack_timeout),
                        ("rnr_nak_retry_err", 0), ("np_cnp_sent", 0), ("rp_cnp_handled", cnp), ("lifespan", 10)):
        write_file(root, f"{base}/hw_counters/{name}", f"{value}\n")
    if netdev is None:
        return
    (Path(root) / f"sys/class/infiniband/{device}/device/net/{netdev}").mkdir(parents=True, exist_ok=True)
    for name, value in (("rx_crc_errors", rx_crc), ("rx_errors", 0), ("tx_errors", 0), ("rx_dropped", 0),
                        ("tx_dropped", 0), ("rx_bytes", 99)):
        write_file(root, f"sys/class/net/{netdev}/statistics/{name}", f"{value}\n")


__all__ = [
    "AER_CORRECTABLE", "AER_CORRECTABLE_4_19", "AER_UNCORRECTABLE", "FakeNodeHardware", "GPU", "ROOT_PORT",
    "aer_table", "write_edac_mc", "write_file", "write_gpu", "write_pci_device", "write_rdma_port",
    "write_thermal_zone",
]
