"""Thermal zone detector: temperatures against each zone's own trip points, from sysfs.

``/sys/class/thermal/thermal_zone<N>/temp`` is in millidegrees Celsius; ``trip_point_<K>_type`` is one of
``active``, ``passive``, ``hot``, ``critical`` with ``trip_point_<K>_temp`` beside it. Reaching ``passive``
means the kernel throttles (warning); ``hot`` is an error; within ``critical_margin_c`` of ``critical`` the node
is about to power off, so a checkpoint should be taken now.

A trip point at or below 0 millidegrees is not set: drivers write ``0`` or ``THERMAL_TEMP_INVALID`` (``-274000``)
there (``x86_pkg_temp`` on Intel servers has two ``passive`` trips at 0 until someone programs them; iwlwifi
and ACPI zones use -274000), and the kernel's own thermal core disables such trips. They are ignored.

A zone whose ``mode`` reads ``disabled`` is not judged against its trips: the kernel does not act on them (it
would not throttle at its passive trip nor power off at its critical one), so a temperature far above a trip is a
bogus trip or a zone left to user space, not throttling or an imminent shutdown. Its temperature is still a
metric, and the status says which zones are disabled.

A condition ends only once the temperature is ``hysteresis_c`` below its threshold (or the trip's own
``trip_point_<K>_hyst``, whichever is larger), as the kernel's thermal core does: a zone the kernel throttles sits
right at its passive trip, and without it every sample crossing the trip by a tenth of a degree raised and cleared
the condition again, an event every 20 s for as long as the node ran hot.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import ClassVar

from trainguard.detectors.base import Detector, DetectorConfig, Sample, register_detector
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.events import Action, Severity
from trainguard.detectors.sysfs import list_dir, read_int, read_text, removed_while_read

_TRIP = re.compile(r"^trip_point_([0-9]+)_type$")  # ASCII: ``\d`` takes other scripts' digits
#: Trip temperatures (millidegrees) at or below this mean "not set" (0, THERMAL_TEMP_INVALID = -274000).
_TRIP_UNSET_MC = 0
#: What reading ``temp`` fails with for a zone that has no temperature to give (now): a policy-only zone such as
#: Intel's "INT3400 Thermal" (ENODATA), a sensor not ready yet (EAGAIN). Not unreadable inputs.
_NO_TEMPERATURE = (errno.ENODATA, errno.EAGAIN)
#: The kernel keeps temperatures and trip points as a C ``int`` of millidegrees (printed ``%d``): a value outside
#: it is a corrupt file. Read as a temperature, a u64 was 1.8e16 C, a critical overheat (checkpoint, FAILED).
_MC_MIN, _MC_MAX = -(1 << 31), (1 << 31) - 1
#: Below absolute zero a ``temp`` is no reading (THERMAL_TEMP_INVALID, -274000): nothing to judge, as ENODATA.
_ABSOLUTE_ZERO_MC = -273150


def _read_millidegrees(path: str) -> int:
    """Reads a ``temp`` or ``trip_point_<n>_temp`` file: millidegrees Celsius within the kernel's ``int``.

    Raises:
        DetectorReadError: unreadable, not an integer, or outside the kernel's ``int``.
    """
    value = read_int(path)
    if not _MC_MIN <= value <= _MC_MAX:
        raise DetectorReadError(path, f"{value} millidegrees is outside the 32-bit value the kernel keeps there "
                                      "(a corrupt file)")
    return value


@dataclass
class ThermalConfig(DetectorConfig):
    """Settings of the thermal detector.

    Attributes:
        interval_s: seconds between samples. Default 10.0.
        critical_margin_c: degrees Celsius below the critical trip point that count as imminent shutdown.
            Default 5.0.
        hysteresis_c: degrees Celsius the temperature must fall below a threshold before its condition ends
            (a trip's own ``trip_point_<K>_hyst`` counts when larger). Default 2.0.
    """

    interval_s: float = 10.0
    critical_margin_c: float = 5.0
    hysteresis_c: float = 2.0

    def validate(self) -> None:
        """Checks ranges.

        Raises:
            DetectorConfigError: a value is out of range.
        """
        super().validate()
        if self.critical_margin_c < 0 or self.hysteresis_c < 0:
            raise DetectorConfigError("thermal: critical_margin_c and hysteresis_c must be >= 0")


@register_detector
class ThermalDetector(Detector):
    """Reads thermal zones."""

    name: ClassVar[str] = "thermal"
    config_class: ClassVar[type[DetectorConfig]] = ThermalConfig
    default_interval_s: ClassVar[float] = 10.0

    def sample(self) -> Sample:
        """Reads every thermal zone once.

        Returns:
            Temperatures (degrees Celsius) and events.
        """
        self.config: ThermalConfig
        base = self.config.path("/sys/class/thermal")
        zones = [z for z in list_dir(base) if z.startswith("thermal_zone")]
        s = Sample()
        self._clear_gone(s, set(zones))
        if not zones:
            gone = s.events
            s = self.no_hardware(f"no thermal zones under {base}")
            s.events = gone
            return s
        hottest = None
        disabled_zones: list[str] = []
        for zone in zones:
            zdir = os.path.join(base, zone)
            try:
                try:
                    millideg = _read_millidegrees(os.path.join(zdir, "temp"))
                except DetectorReadError as exc:
                    if isinstance(exc.__cause__, OSError) and exc.__cause__.errno in _NO_TEMPERATURE:
                        continue  # nothing to judge in this zone now; the others are read
                    raise
                if millideg < _ABSOLUTE_ZERO_MC:
                    continue  # the driver's "no valid temperature": nothing to judge now, as ENODATA
                temp = millideg / 1000.0
                trips: dict[str, float] = {}
                hyst: dict[str, float] = {}
                for f in list_dir(zdir):
                    m = _TRIP.match(f)
                    if m:
                        kind = read_text(os.path.join(zdir, f))
                        millideg = _read_millidegrees(os.path.join(zdir, f"trip_point_{m.group(1)}_temp"))
                        if millideg <= _TRIP_UNSET_MC:
                            continue  # an unset trip: every temperature is "above" it
                        value = millideg / 1000.0
                        if value <= trips.get(kind, value):
                            trips[kind] = value
                            hyst[kind] = self._trip_hyst(zdir, m.group(1))
            except DetectorReadError as exc:
                # Removed since it was listed (its NIC or NVMe driver unloaded, the device went), before or while
                # its temperature or a trip point was read: gone, not unreadable; its conditions end at the next
                # listing. Only a temp opened after the removal (ENOENT) was told so; one open as the zone went
                # (ENODEV) or a trip point read after it were read errors.
                if not removed_while_read(exc, zdir):
                    s.error(exc)
                continue
            try:
                ztype = read_text(os.path.join(zdir, "type"))
            except DetectorReadError:
                ztype = zone
            subject = f"{zone}:{ztype}"
            s.metrics[f"temp_c[{subject}]"] = temp
            hottest = temp if hottest is None else max(hottest, temp)
            evidence = {"temp_c": temp, **{f"trip_{k}_c": v for k, v in sorted(trips.items())}}
            critical = trips.get("critical")
            margin = self.config.critical_margin_c
            disabled = self._disabled(s, zdir)
            if disabled:
                # The kernel does not act on a disabled zone's trips (no shutdown at its critical trip): a zone
                # far above its critical trip and still running is one of these, or its trip is bogus. It raised
                # hw.temp_critical (checkpoint now, FAILED) for as long as the node ran.
                s.metrics[f"zone_disabled[{subject}]"] = 1.0
                disabled_zones.append(subject)
                self.condition(s, f"crit/{zone}", False, "hw.temp_critical", Severity.CRITICAL,
                               Action.CHECKPOINT_NOW, f"{subject} is disabled (its mode): its critical trip "
                               f"{critical} C is not judged", subject, evidence)
            else:
                self.condition(s, f"crit/{zone}",
                               self._over(f"crit/{zone}", temp, None if critical is None else critical - margin,
                                          hyst.get("critical", 0.0)),
                               "hw.temp_critical", Severity.CRITICAL, Action.CHECKPOINT_NOW,
                               f"{subject} at {temp:.1f} C, near its critical trip {critical} C", subject, evidence)
            # Nor does it throttle a disabled zone at its passive trip: "throttled" was untrue, and a zone far
            # above its bogus passive and hot trips stayed a warning and an error for as long as the node ran.
            self.condition(s, f"hot/{zone}",
                           not disabled and self._over(f"hot/{zone}", temp, trips.get("hot"), hyst.get("hot", 0.0)),
                           "hw.temp_hot", Severity.ERROR, Action.WATCH,
                           f"{subject} is disabled (its mode): its hot trip {trips.get('hot')} C is not judged"
                           if disabled else
                           f"{subject} at {temp:.1f} C, above its hot trip {trips.get('hot')} C", subject, evidence)
            self.condition(s, f"passive/{zone}",
                           not disabled and self._over(f"passive/{zone}", temp, trips.get("passive"),
                                                       hyst.get("passive", 0.0)),
                           "hw.temp_throttling", Severity.WARNING, Action.WATCH,
                           f"{subject} is disabled (its mode): the kernel does not throttle it at its passive trip "
                           f"{trips.get('passive')} C" if disabled else
                           f"{subject} at {temp:.1f} C, throttled above {trips.get('passive')} C", subject, evidence)
        s.metrics["zones"] = float(len(zones))
        if disabled_zones and not s.detail:
            s.detail = (f"disabled thermal zone(s), trips not judged: {', '.join(disabled_zones)} (their "
                        "mode reads 'disabled': the kernel does not act on their trips)")
        if hottest is not None:
            s.metrics["max_temp_c"] = hottest
        return s

    def _clear_gone(self, s: Sample, zones: set[str]) -> None:
        """Ends the conditions of zones no longer listed. A zone goes with its driver (a NIC's or NVMe drive's
        zone when the driver reloads or the device is removed); its condition stayed active for good, listed
        among the node's active conditions for a zone that no longer exists."""
        for key, started in list(self._active.items()):
            _, _, zone = key.partition("/")
            if zone.startswith("thermal_zone") and zone not in zones:
                self.condition(s, key, False, started.kind, started.severity, started.action,
                               f"{started.subject} is gone (its zone was removed)", started.subject)

    @staticmethod
    def _disabled(s: Sample, zdir: str) -> bool:
        """Whether the zone's ``mode`` reads ``disabled`` (Documentation/ABI/testing/sysfs-class-thermal: the
        kernel's thermal management of the zone is off, its trips are not acted on). A zone without the file,
        or whose driver cannot tell (-EPERM before 5.9), is enabled; any other word is a read error naming the
        file, and the zone is judged as enabled (an overheat is not hidden on a garbled file)."""
        path = os.path.join(zdir, "mode")
        if not os.path.exists(path):
            return False
        try:
            mode = read_text(path)
        except DetectorReadError as exc:
            cause = exc.__cause__
            if not (isinstance(cause, OSError) and cause.errno == errno.EPERM) and not removed_while_read(exc, zdir):
                s.error(exc)
            return False
        if mode not in ("enabled", "disabled"):
            s.error(DetectorReadError(path, f"expected 'enabled' or 'disabled', found {mode[:40]!r}"))
        return mode == "disabled"

    def _over(self, key: str, temp: float, threshold: float | None, trip_hyst: float) -> bool:
        """Whether ``temp`` is at or above ``threshold``; a condition already active holds until the temperature
        is a hysteresis below it."""
        if threshold is None:
            return False
        if key in self._active:
            return temp > threshold - max(self.config.hysteresis_c, trip_hyst)
        return temp >= threshold

    @staticmethod
    def _trip_hyst(zdir: str, number: str) -> float:
        """A trip's own hysteresis in degrees Celsius (0 when the driver has none or it cannot be read)."""
        path = os.path.join(zdir, f"trip_point_{number}_hyst")
        if not os.path.exists(path):
            return 0.0
        try:
            return max(0, read_int(path)) / 1000.0
        except DetectorReadError:
            return 0.0  # evidence of a tolerance only; the trip itself was read
