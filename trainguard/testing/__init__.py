"""Fakes of node hardware for tests and drills: a public, stable API.

trainguard's detectors read the node through files (sysfs, procfs, ``/dev/kmsg``) under a configurable root,
through netlink, and through NVML. These helpers build each of those in the kernel's (or NVML's) own formats, so
the *real* detectors, predictor and agent run unchanged on a machine without the hardware: point a detector's
``root`` (``trainguard run --detector-config``, the daemon's ``detectors.root``) at the folder, then write faults
into it while the job runs. trainguard's own tests and ``trainguard drill`` use them; so can yours.

- :mod:`trainguard.testing.sysfs`: PCIe devices with AER tables and link width/speed
  (:func:`~trainguard.testing.sysfs.write_pci_device`, :class:`~trainguard.testing.sysfs.FakeNodeHardware` with
  ``narrow_link()`` / ``aer_fatal()``), thermal zones, EDAC memory controllers, RDMA ports, any file;
- :mod:`trainguard.testing.kmsg`: a ``/dev/kmsg`` in the kernel's record format;
- :mod:`trainguard.testing.nvml`: :class:`~trainguard.testing.nvml.GpuBackendDouble`, NVML behind the NVIDIA
  detector's backend seam;
- :mod:`trainguard.testing.netns`: :func:`~trainguard.testing.netns.veth_pair`, a namespace with a real veth pair
  (root only) for link-state tests over netlink.

Stability: names exported here follow the package's version like any public API; new keyword arguments get
defaults. Nothing here touches the real system outside the folder or namespace it is given.
"""

from trainguard.testing.kmsg import append_kmsg, write_kmsg
from trainguard.testing.netns import NetnsUnavailable, veth_pair
from trainguard.testing.sysfs import (
    GPU,
    ROOT_PORT,
    FakeNodeHardware,
    write_edac_mc,
    write_file,
    write_gpu,
    write_pci_device,
    write_rdma_port,
    write_thermal_zone,
)

__all__ = [
    "FakeNodeHardware", "GPU", "NetnsUnavailable", "ROOT_PORT", "append_kmsg", "veth_pair", "write_edac_mc",
    "write_file", "write_gpu", "write_kmsg", "write_pci_device", "write_rdma_port", "write_thermal_zone",
]
