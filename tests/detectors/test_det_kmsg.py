"""Kernel log detector: record parsing, rules over fake /dev/kmsg files, malformed records, the real device."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from trainguard.detectors.base import DetectorState
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.kmsg import KmsgConfig, KmsgDetector, parse_record
from trainguard.detectors.runner import DetectorRunner
from trainguard.testing.kmsg import append_kmsg, write_kmsg

XID79 = "6,1201,5123456789,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
XID13 = "4,1202,5123456790,-;NVRM: Xid (PCI:0000:5e:00): 13, pid=4242, name=python3, Graphics SM Warp Exception"
OOM = ("3,1203,5123456791,-;Out of memory: Killed process 23456 (python3) total-vm:98765432kB, "
       "anon-rss:87654321kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:180000kB oom_score_adj:0")
MCE = "2,1204,5123456792,-;mce: [Hardware Error]: Machine check events logged"
AER = ("3,1205,5123456793,-;pcieport 0000:00:03.0: AER: Uncorrected (Fatal) error received: 0000:3b:00.0\n"
       " SUBSYSTEM=pci\n DEVICE=+pci:0000:00:03.0")
NOISE = "6,1206,5123456794,-;e1000e: eth0 NIC Link is Up 1000 Mbps Full Duplex"


def test_parse_record_prefix_continuation_and_escapes() -> None:
    r = parse_record(AER)
    assert (r.facility, r.level, r.sequence, r.timestamp_us) == (0, 3, 1205, 5123456793)
    assert r.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:00:03.0"}
    r = parse_record("11,5,6,-,caller=T12;tab\\x09here")
    assert (r.facility, r.level, r.message) == (1, 3, "tab\there")
    for bad in ("no prefix at all", "x,1,2,-;msg", "6,1;msg"):
        with pytest.raises(ValueError):
            parse_record(bad)


def test_rules_turn_records_into_typed_events(tmp_path) -> None:
    root = write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=root))
    assert det.sample().events == []
    append_kmsg(tmp_path, XID79, XID13, OOM, MCE, AER, NOISE)
    s = det.sample()
    by_kind = {e.kind: e for e in s.events}
    assert [e.kind for e in s.events] == ["gpu.xid", "gpu.xid", "proc.oom_kill", "hw.mce_corrected", "pcie.aer_fatal"]
    xids = [e for e in s.events if e.kind == "gpu.xid"]
    assert [(e.subject, e.evidence["xid"], e.action, e.severity) for e in xids] == [
        ("0000:3b:00", "79", Action.DRAIN_NODE, Severity.CRITICAL),
        ("0000:5e:00", "13", Action.RESTART_PROCESS, Severity.ERROR),
    ]
    assert xids[0].evidence["nvidia_action"] == "RESTART_BM"
    oom = by_kind["proc.oom_kill"]
    assert oom.subject == "23456" and oom.action == Action.RESTART_PROCESS and "python3" in oom.message
    assert by_kind["hw.mce_corrected"].severity == Severity.WARNING
    aer = by_kind["pcie.aer_fatal"]
    assert aer.subject == "0000:3b:00.0" and aer.evidence["SUBSYSTEM"] == "pci"
    assert s.state == DetectorState.FAILED
    assert s.metrics["matches_nvidia_xid"] == 2.0 and s.metrics["records"] == 6.0


def test_aer_lines_of_old_and_new_kernels_both_match(tmp_path) -> None:
    """Newer kernels print "AER: Uncorrected (Non-Fatal) error message received from <bdf>" (older: "error
    received: <bdf>"); the fatal rule knew both, the non-fatal one only the old: a non-fatal error on a current
    kernel raised nothing."""
    write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=str(tmp_path)))
    det.sample()
    lines = [("Fatal", "error received: 0000:3b:00.0"), ("Fatal", "error message received from 0000:3c:00.0"),
             ("Non-Fatal", "error received: 0000:3d:00.0"),
             ("Non-Fatal", "error message received from 0000:3e:00.0")]
    for seq, (severity, tail) in enumerate(lines, 1):
        append_kmsg(tmp_path, f"3,{seq},100,-;pcieport 0000:00:03.0: AER: Multiple Uncorrected ({severity}) {tail}")
    got = [(e.kind, e.subject) for e in det.sample().events]
    assert got == [("pcie.aer_fatal", "0000:3b:00.0"), ("pcie.aer_fatal", "0000:3c:00.0"),
                   ("pcie.aer_nonfatal", "0000:3d:00.0"), ("pcie.aer_nonfatal", "0000:3e:00.0")], got


def test_tx_timeouts_and_cpu_throttling_of_current_kernels_match(tmp_path) -> None:
    """Linux 6.8 logs a transmit timeout through netdev_crit() ("<driver> <bus id> <ifname>: NETDEV WATCHDOG: CPU:
    <n>: transmit queue <q> timed out <ms> ms"), and since 5.7 CPU throttling reads "temperature is above
    threshold, cpu clock is throttled": the rules knew only the older lines, so neither raised anything on a
    current kernel."""
    write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=str(tmp_path), dedup_s=0.0))  # both throttle lines: one event each
    det.sample()
    lines = ["NETDEV WATCHDOG: eth2 (mlx5_core): transmit queue 7 timed out 5000 ms",
             "mlx5_core 0000:3b:00.0 ens1f0np0: NETDEV WATCHDOG: CPU: 2: transmit queue 3 timed out 5276 ms",
             "veth0: NETDEV WATCHDOG: CPU: 0: transmit queue 0 timed out 5000 ms",
             "CPU7: Package temperature above threshold, cpu clock throttled (total events = 1)",
             "CPU3: Core temperature is above threshold, cpu clock is throttled (total events = 219)"]
    append_kmsg(tmp_path, *(f"4,{seq},100,-;{line}" for seq, line in enumerate(lines, 1)))
    got = [(e.kind, e.subject, e.action) for e in det.sample().events]
    tx = (Action.CHECKPOINT_NOW, "net.tx_timeout")
    assert got == [(tx[1], "eth2", tx[0]), (tx[1], "ens1f0np0", tx[0]), (tx[1], "veth0", tx[0]),
                   ("hw.cpu_throttled", "", Action.WATCH), ("hw.cpu_throttled", "", Action.WATCH)], got


def test_existing_records_are_skipped_unless_replay(tmp_path) -> None:
    root = write_kmsg(tmp_path, OOM)
    assert KmsgDetector(KmsgConfig(root=root)).sample().events == []
    assert [e.kind for e in KmsgDetector(KmsgConfig(root=root, replay=True)).sample().events] == ["proc.oom_kill"]


def test_unknown_xid_uses_the_default_entry_and_floods_are_deduplicated(tmp_path) -> None:
    root = write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=root, dedup_s=60))
    det.sample()
    line = "4,{},1,-;NVRM: Xid (PCI:0000:3b:00): 999, pid=1, name=x, something new"
    append_kmsg(tmp_path, *(line.format(i) for i in range(50)))
    s = det.sample()
    assert len(s.events) == 1 and s.events[0].evidence["xid_name"] == "unknown Xid"
    assert s.events[0].action == Action.WATCH
    assert s.metrics["suppressed"] == 49.0


def test_malformed_and_truncated_records_yield_detector_error_events(tmp_path) -> None:
    root = write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=root))
    det.sample()
    append_kmsg(tmp_path, "garbage without prefix", "6,12", OOM)
    with open(tmp_path / "dev" / "kmsg", "a") as f:
        f.write("6,99,1,-;Out of memory: Killed proc")  # truncated: no newline yet, waits for the rest
    events = []
    runner = DetectorRunner([det], on_event=events.append)
    runner.run_once()
    kinds = [e.kind for e in events]
    assert kinds.count("detector.error") == 2 and "proc.oom_kill" in kinds
    assert runner.statuses()[0].state == DetectorState.FAILED  # the OOM kill outranks the read error
    # The same problems are not reported again; a clean sample clears them.
    events.clear()
    runner.run_once()
    assert [e.kind for e in events] == ["detector.error.cleared"]


def test_only_malformed_records_put_the_detector_in_error_state(tmp_path) -> None:
    root = write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=root))
    det.sample()
    append_kmsg(tmp_path, "\x00\x01binary junk;")
    s = det.sample()
    assert s.state == DetectorState.ERROR and len(s.errors) == 1 and "malformed record" in s.detail


def test_missing_device_is_no_hardware(tmp_path) -> None:
    s = KmsgDetector(KmsgConfig(root=str(tmp_path))).sample()
    assert s.state == DetectorState.NO_HARDWARE and "kmsg" in s.detail


def test_real_dev_kmsg_user_facility_line(tmp_path) -> None:
    if not os.access("/dev/kmsg", os.R_OK | os.W_OK):
        pytest.skip("/dev/kmsg is not readable and writable here (needs root)")
    marker = f"trainguard-selftest-{uuid.uuid4().hex}"
    rules = {"rules": [{"name": "selftest", "pattern": f"{marker} (?P<what>\\w+)", "kind": "test.selftest",
                        "severity": "warning", "action": "watch", "subject": "what", "message": "saw {what}"}]}
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(rules))
    det = KmsgDetector(KmsgConfig(rules_file=str(path)))
    try:
        det.sample()
        with open("/dev/kmsg", "w") as f:
            f.write(f"<4>{marker} hello\n")
        s = det.sample()
        assert [(e.kind, e.subject) for e in s.events] == [("test.selftest", "hello")]
        assert s.events[0].evidence["facility"] == "1"
    finally:
        det.close()


def test_a_read_error_mid_sample_keeps_the_records_read_before_it() -> None:
    """A read error after some records (here a pty master whose other end closed: its pending record, then EIO)
    raised out of the sample, dropping records already consumed from the device: the Xid below was never
    reported. The records read are matched and the error reported beside them."""
    import fcntl
    import struct
    import tty

    det = KmsgDetector(KmsgConfig(root="/", device="/dev/ptmx", replay=True))  # a tty: no seeking to the end
    slave = -1
    try:
        assert det.sample().events == []  # opens the master
        master = det._fd  # the device's other end is the test's to write
        fcntl.ioctl(master, 0x40045431, struct.pack("i", 0))  # TIOCSPTLCK: unlock the peer
        index = struct.unpack("I", fcntl.ioctl(master, 0x80045430, struct.pack("I", 0)))[0]  # TIOCGPTN
        slave = os.open(f"/dev/pts/{index}", os.O_RDWR | os.O_NOCTTY)
        tty.setraw(slave)
        os.write(slave, b"3,7,100,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n")
        os.close(slave)
        slave = -1
        s = det.sample()
        assert [(e.kind, e.subject) for e in s.events] == [("gpu.xid", "0000:3b:00")]
        assert len(s.errors) == 1 and "read failed" in str(s.errors[0])
        assert s.state == DetectorState.FAILED and s.metrics["records"] == 1.0
    finally:
        if slave >= 0:
            os.close(slave)
        det.close()


def test_xid_and_prefix_digits_of_other_scripts_are_no_numbers(tmp_path) -> None:
    """``\\d`` and int() took Arabic-Indic '٧٩' and fullwidth '７９' as Xid 79: a drain on text no driver prints.
    Only ASCII digits are a code, in a rule's pattern and in the record prefix; an operator pattern capturing
    something else as the Xid is a read error, not a ValueError out of the sample."""
    root = write_kmsg(tmp_path)
    det = KmsgDetector(KmsgConfig(root=root))
    det.sample()
    append_kmsg(tmp_path, "6,1,1,-;NVRM: Xid (PCI:0000:3b:00): \u0667\u0669, pid=1, GPU has fallen off the bus.",
                "6,2,1,-;NVRM: Xid (PCI:0000:3b:00): \uff17\uff19, pid=1, GPU has fallen off the bus.")
    s = det.sample()
    assert [e.kind for e in s.events if e.kind == "gpu.xid"] == [] and s.metrics["matches_nvidia_xid"] == 0.0
    with pytest.raises(ValueError):
        parse_record("\uff16,1,1,-;message")

    rules = {"rules": [{"name": "loose", "pattern": r"Xid: (?P<xid>\S+)", "kind": "gpu.xid", "lookup": "xid",
                        "severity": "error", "action": "watch", "message": "Xid {xid}"}]}
    (tmp_path / "rules.json").write_text(json.dumps(rules))
    det = KmsgDetector(KmsgConfig(root=root, rules_file=str(tmp_path / "rules.json")))
    det.sample()
    append_kmsg(tmp_path, "6,3,1,-;Xid: 79x", "6,4,1,-;Xid: 48")
    s = det.sample()
    assert [e.evidence["xid"] for e in s.events] == ["48"]
    assert len(s.errors) == 1 and "'79x' is not an Xid code" in str(s.errors[0])
