"""torchrun's flag values, checked and mapped onto trainguard's model.

torchrun finds its peers through a rendezvous backend; trainguard's agents register with a coordinator instead,
which forms every generation's rank table. The mapping (see :func:`resolve_rendezvous`):

- ``--coordinator HOST:PORT``: join that coordinator (trainguard's own flag wins over the rendezvous flags).
- ``--standalone``: embed a coordinator on a free loopback port (one node only).
- ``--rdzv-backend c10d --rdzv-endpoint HOST[:PORT]``: the coordinator is at HOST:PORT (port 29400 as in
  torchrun). The node where HOST is a local address embeds it there (``--rdzv-conf is_host=...`` forces the
  choice); if another local agent already holds the port, this one joins it, as torchrun's c10d backend does.
- ``--rdzv-backend static`` (torchrun's default): with more than one node the coordinator is at
  ``--rdzv-endpoint`` when given, else ``--master-addr:--master-port`` (port 29500), as torchrun's static
  backend picks it, embedded by ``--node-rank 0``; on one node it is embedded on a free loopback port.
- ``--nnodes MIN:MAX``: as torchrun's rendezvous, once MIN nodes have registered the job waits up to
  ``--rdzv-conf last_call_timeout`` (30 s) for more and starts with those there, at once when MAX are; nodes
  arriving later wait as standbys: a lost node is replaced by one, or the job shrinks, never below MIN.
- ``--rdzv-id``: the job name. Without it (and without ``--job``) a job with a rendezvous endpoint (every
  multi-node one) is named after the script and the endpoint's port (``train-29500``), the same on every node, as
  torchrun's constant default id is; a one-node job on a free port is named after the script and its
  checkpoint directory (so rerunning the command resumes the same job), or the start time without one.

The workers' store is not the rendezvous: every generation gets a new one (see :mod:`trainguard.agent.worker_store`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import secrets
import signal
import socket
from dataclasses import dataclass, field

from trainguard.errors import UsageError
from trainguard.worker_env import checkpoint_job_name, job_name_from, run_id_job_name

log = logging.getLogger(__name__)

C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_PORT = 29500
#: torchrun's rendezvous backends; etcd ones name an etcd server, which trainguard's coordinator replaces.
_BACKENDS = ("static", "c10d")
_ETCD_BACKENDS = ("etcd", "etcd-v2")
#: ``--rdzv-conf`` keys torchrun documents; the ones trainguard uses are join_timeout, last_call_timeout and
#: is_host.
_RDZV_KEYS = frozenset({"join_timeout", "last_call_timeout", "close_timeout", "timeout", "read_timeout",
                        "is_host", "keep_alive_interval", "keep_alive_max_attempt", "use_libuv", "store_type",
                        "rank", "local_addr"})


@dataclass(frozen=True)
class StreamSpec:
    """Where one local rank's stdout and stderr go: each is ``console``, ``file``, ``tee`` or ``null``."""

    stdout: str = "console"
    stderr: str = "console"


@dataclass(frozen=True)
class Rendezvous:
    """How this node finds the job's coordinator.

    Attributes:
        coordinator: address to join; None when this node embeds the coordinator.
        listen: where the embedded coordinator listens (``host:port``; port 0 picks a free one).
        min_nodes: nodes that must register before the first generation.
        max_nodes: most nodes the job takes (the rest beyond ``min_nodes`` wait as standbys).
        job: job name (``--job`` else ``--rdzv-id``), None for the default.
        join_timeout_s: how long the coordinator may be unreachable at registration (``join_timeout``, else
            60 s: a wrong address fails in a minute).
        form_timeout_s: how long the first generation may lack ``min_nodes`` before this node gives up
            (``join_timeout``, else torchrun's default of 600 s: nodes of one job often start minutes apart).
        last_call_s: once ``min_nodes`` registered, how long the first generation waits for more, up to
            ``max_nodes`` (torchrun's ``last_call_timeout``), seconds.
        multi_node: the job may span more than one node.
        join_if_taken: when the embedded coordinator cannot listen (another agent on this host got there
            first), join the one at ``listen`` instead (torchrun's c10d backend does the same).
        endpoint: the rendezvous endpoint every node of the job names (``--rdzv-endpoint``,
            ``--master-addr:--master-port`` or ``--coordinator``); empty for a one-node job on a free port.
        static_rank: ``--node-rank`` of a multi-node static rendezvous (None otherwise).
        bind: where the embedded coordinator binds when that is not ``listen`` ("": ``listen``); see
            :func:`embed_bind`.
    """

    coordinator: str | None
    listen: str
    min_nodes: int
    max_nodes: int
    job: str | None
    join_timeout_s: float = 60.0
    form_timeout_s: float = 600.0
    last_call_s: float = 30.0
    multi_node: bool = False
    conf: dict[str, str] = field(default_factory=dict)
    join_if_taken: bool = False
    endpoint: str = ""
    static_rank: int | None = None
    bind: str = ""


def embed_bind(host: str, port: int, multi_node: bool) -> str:
    """Where a coordinator embedded for rendezvous endpoint ``host:port`` binds ("": at the endpoint itself).

    torchrun's rendezvous store listens on every interface at the endpoint's port. A multi-node endpoint named
    by a host name does the same here: the name may resolve to loopback on its own host (Debian and Ubuntu map
    the host's name to 127.0.1.1 in /etc/hosts) while the other nodes resolve it to the host's network address,
    and a coordinator bound to what the name means locally refused every other node. An address literal binds
    as given (it names the interface the other nodes dial), as does a one-node job.
    """
    if not multi_node or host == "localhost":
        return ""
    try:
        ipaddress.ip_address(host.strip("[]").split("%")[0])
        return ""
    except ValueError:
        return join_endpoint("0.0.0.0", port)


def _first_address(addresses: str) -> str:
    """The first of a ``--coordinator`` list (where the coordinator runs first; the others are where it may be
    restarted), which decides what a list's node is called and the address it is reached at."""
    return next((a.strip() for a in addresses.split(",") if a.strip()), addresses)


def default_node_id(rdzv: Rendezvous, joining: str | None, hostname: str, pid: int) -> str:
    """The node id when ``--node-id`` is not given; ``joining`` is the coordinator this agent joins (None when
    it embeds it).

    Several agents of one multi-node job may run on one host, and the coordinator takes a second agent with an
    id it knows for a restart of the first (it takes the slot over). So the id is unique per agent there:

    - static rendezvous with more than one node: ``HOST-rRANK`` (``--node-rank`` is unique and stable, so a
      restarted agent keeps its slot);
    - an agent joining a coordinator on its own host (the c10d agent that found the endpoint taken, or
      ``--coordinator`` at a local address): ``HOST-pPID`` (a restarted agent is a new node; its old slot goes
      when the lease ends; give ``--node-id`` to keep it);
    - otherwise (the agent that embeds the coordinator, one per host by its port; an agent joining another
      host): the host name, stable across restarts.
    """
    if rdzv.static_rank is not None:
        return f"{hostname}-r{rdzv.static_rank}"
    if joining is not None:
        host, _ = split_endpoint(_first_address(joining), 0, "--coordinator")
        if is_local_host(host.strip("[]")):
            return f"{hostname}-p{pid}"
    return hostname


def default_job_name(script: str, rdzv: Rendezvous, now: float, checkpoint_dir: str | None = None,
                     module: bool = False, pid: int | None = None) -> str:
    """The job name when neither ``--job`` nor ``--rdzv-id`` is given.

    A job with a rendezvous endpoint (every multi-node one) needs the same name on every node, whenever each
    starts: the script's name plus the rendezvous port (torchrun's default rendezvous id is the constant
    ``none``; the port keeps two jobs of one script on different endpoints apart). A one-node job on a free port
    with a checkpoint directory is named after the script and that directory (its resolved path or URL,
    hashed): rerunning the same command after a crash is the same job, so it finds its in-memory checkpoint
    (which the node's daemon keeps for a while), and two runs of one script on other directories do not share
    one. Without a checkpoint directory there is nothing to resume: the start time ``now``, the launcher's ``pid``
    (default: this process) and 4 random hex digits keep runs apart; the time alone, in whole seconds, named two
    runs of one script started in the same second alike, and the second was refused as "already running here".

    A ``-m`` module (``module``) is named after its last component, as the hook names it under torchrun (whose
    ``sys.argv[0]`` is the module's file): ``-m pkg.train`` was ``pkg-...``, so either launcher missed the other's
    checkpoints, and ``-m pkg.train`` and ``-m pkg.finetune`` on one checkpoint directory were one job.
    """
    if module:
        script = script.rsplit(".", 1)[-1]
    stem = os.path.splitext(os.path.basename(script.rstrip("/")))[0] or "job"
    if rdzv.endpoint:
        _, port = split_endpoint(_first_address(rdzv.endpoint), 0, "--rdzv-endpoint")
        return job_name_from(stem, str(port))
    if checkpoint_dir:
        # The hook names a torchrun launch's checkpoints the same way: either launcher resumes the other's.
        return checkpoint_job_name(script, checkpoint_dir)
    # The pid tells the operator which launcher; the random part keeps apart launchers of one pid in
    # containers that share the host's memory-tier root (each launcher often pid 1 there).
    return job_name_from(stem, f"{int(now)}-{os.getpid() if pid is None else pid}-{secrets.token_hex(2)}")


def parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (min, max).

    Raises:
        UsageError: not integers, or not 1 <= MIN <= MAX.
    """
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: taskset, cgroup cpusets, Slurm's binding), as
    torchrun counts them for ``--nproc-per-node cpu``; ``os.cpu_count()`` counts the machine's, so a job bound
    to 2 of 64 cores started 64 workers where torchrun starts 2."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def resolve_nproc(text: str) -> int:
    """``N``, ``gpu``, ``auto`` or ``cpu`` -> the local worker count, as torchrun resolves it.

    Raises:
        UsageError: not a positive count or one of the names, or ``gpu`` without a CUDA device.
    """
    text = str(text)
    if text.lstrip("-").isdigit():
        n = int(text)
        if n < 1:
            raise UsageError(f"--nproc-per-node must be >= 1, got {n}")
        return n
    if text == "cpu":
        return usable_cpus()
    if text in ("gpu", "auto"):
        import torch  # only for these two names: the count of accelerators needs it

        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
        if text == "gpu":
            raise UsageError("--nproc-per-node gpu: CUDA is not available on this node; give a count or 'cpu'")
        return usable_cpus()
    raise UsageError(f"--nproc-per-node {text!r}: expected a count, gpu, auto or cpu")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``key=value,key=value`` -> dict, as torchrun parses ``--rdzv-conf``.

    Raises:
        UsageError: an entry without ``=``.
    """
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in str(text).split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--rdzv-conf {text!r}: expected key=value pairs separated by commas, got {item!r}")
        conf[key.strip()] = value.strip()
    unknown = sorted(set(conf) - _RDZV_KEYS)
    if unknown:
        log.warning("--rdzv-conf: ignoring unknown key(s) %s", ", ".join(unknown))
    return conf


def _conf_bool(conf: dict[str, str], key: str) -> bool | None:
    if key not in conf:
        return None
    value = conf[key].lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise UsageError(f"--rdzv-conf {key}={conf[key]!r}: expected true or false")


def _conf_seconds(conf: dict[str, str], key: str, default: float) -> float:
    if key not in conf:
        return default
    try:
        value = float(conf[key])
    except ValueError:
        raise UsageError(f"--rdzv-conf {key}={conf[key]!r}: expected seconds") from None
    if not (value > 0 and math.isfinite(value)):  # nan passed "<= 0", and reached the coordinator's spec unnamed
        raise UsageError(f"--rdzv-conf {key}={conf[key]!r}: must be a finite number of seconds > 0")
    return value


def split_endpoint(text: str, default_port: int, flag: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[v6]:PORT`` too) -> (host, port).

    Raises:
        UsageError: empty host or a port outside 0..65535, naming ``flag``.
    """
    text = text.strip()
    host, port_text = text, ""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    try:
        port = int(port_text) if port_text else default_port
    except ValueError:
        raise UsageError(f"{flag} {text!r}: the port must be a number") from None
    if not host or not 0 <= port <= 65535:
        raise UsageError(f"{flag} {text!r}: expected HOST[:PORT] with a port in 0..65535")
    if ":" in host and not text.startswith("["):
        # Only an IPv6 address has colons in its host part; anything else (a URL, an etcd-style list of
        # endpoints) was taken for one and dialled as '[http://h:29400]:29400' until the join timeout.
        try:
            ipaddress.IPv6Address(host.split("%")[0])
        except ValueError:
            raise UsageError(f"{flag} {text!r}: expected one HOST[:PORT] without a scheme (an IPv6 address in "
                             "brackets: [fd00::1]:29400)") from None
    return host, port


def join_endpoint(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def dial_target(target: str) -> str:
    """``target`` (``host:port``) with an IPv6 literal bracketed: ``::1:5000`` -> ``[::1]:5000``.

    The embedded coordinator reports ``host:port`` unbracketed; gRPC cannot dial that, so an agent serving
    ``--rdzv-endpoint [::1]:PORT`` waited out its join timeout against its own coordinator.
    """
    host, sep, port = target.rpartition(":")
    if not sep or target.startswith("[") or ":" not in host or not port.isdigit():
        return target
    return join_endpoint(host, int(port))


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, its host name, or one of its interface addresses)."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return True
    import psutil

    mine = {a.address.split("%")[0] for nics in psutil.net_if_addrs().values() for a in nics}
    return bool(addrs & mine)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback name or address (unreachable from other nodes)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def port_free(hostport: str) -> bool:
    """Whether ``HOST:PORT`` (``[v6]:PORT``) can be bound now; port 0 always can, and an address that does not
    parse is left for the server to report."""
    from trainguard.agent.config import parse_hostport

    try:
        host, port = parse_hostport(hostport)
    except ValueError:
        return True
    return port == 0 or _port_free(host, port)


def _port_free(host: str, port: int) -> bool:
    from trainguard.ports import can_listen

    return can_listen(host, port)


def resolve_rendezvous(args: argparse.Namespace) -> Rendezvous:
    """Maps the rendezvous flags onto a coordinator to embed or join (see the module docstring).

    Raises:
        UsageError: an unknown backend, conflicting flags, or a bad endpoint, naming the flag.
    """
    lo, hi = parse_nnodes(args.nnodes)
    conf = parse_rdzv_conf(args.rdzv_conf)
    join_timeout = _conf_seconds(conf, "join_timeout", 60.0)
    # torchrun's join_timeout (600 s) bounds the whole rendezvous. A node waiting for peers keeps that default, but
    # an unreachable coordinator fails after a minute unless join_timeout is given (a typo in the address should
    # not cost ten minutes).
    form_timeout = _conf_seconds(conf, "join_timeout", 600.0)
    last_call = _conf_seconds(conf, "last_call_timeout", 30.0)
    job = args.job or (run_id_job_name(args.rdzv_id) if args.rdzv_id else args.rdzv_id)
    if not args.job and args.rdzv_id and job != args.rdzv_id:
        log.info("--rdzv-id %r names job %s (a job name holds only letters, digits and ._:@-)", args.rdzv_id, job)
    is_host = _conf_bool(conf, "is_host")  # checked whether or not the backend reads it
    if args.node_rank < 0:
        raise UsageError(f"--node-rank {args.node_rank}: expected >= 0")
    # 0 on one node: torchrun picks a free port; trainguard picks every port of a one-node job itself.
    if args.master_port is not None and not (0 < args.master_port <= 65535 or args.master_port == 0 and hi == 1):
        raise UsageError(f"--master-port {args.master_port}: expected 1..65535")
    backend = str(args.rdzv_backend).lower().replace("_", "-")
    if backend in _ETCD_BACKENDS:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend}: trainguard's coordinator replaces the etcd rendezvous;"
                         " use --rdzv-backend c10d --rdzv-endpoint HOST:PORT of the node that embeds it")
    if backend not in _BACKENDS:
        raise UsageError(f"--rdzv-backend {args.rdzv_backend!r}: expected static or c10d")
    common = dict(min_nodes=lo, max_nodes=hi, job=job, join_timeout_s=join_timeout, form_timeout_s=form_timeout,
                  last_call_s=last_call,
                  multi_node=hi > 1, conf=conf)
    if args.rdzv_endpoint:
        # Checked whichever path uses it: a one-node static rendezvous (and --standalone) never reads the
        # endpoint, so 'localhost:x' passed there and was refused only once the job grew to two nodes or c10d.
        split_endpoint(args.rdzv_endpoint, C10D_DEFAULT_PORT if backend == "c10d" else STATIC_DEFAULT_PORT,
                       "--rdzv-endpoint")
    listen_flag = args.coordinator_listen
    if args.coordinator:
        if args.standalone:
            raise UsageError("--standalone embeds a coordinator; it cannot be combined with --coordinator")
        # Without --nnodes the job may still span nodes (the coordinator knows its size), unless the coordinator
        # is at a loopback address: then every node of the job is on this host and 127.0.0.1 reaches them all.
        # A comma-separated list names a coordinator and where it may be restarted (the link tries them in turn).
        hosts = []
        for one in (t.strip() for t in args.coordinator.split(",")):
            if not one:
                continue
            host, port = split_endpoint(one, 0, "--coordinator")
            if port == 0 or not one.rpartition(":")[2].isdigit():
                # gRPC dials a target without a port at 443: '--coordinator HOST' waited out the join timeout
                # against a port no coordinator listens on.
                raise UsageError(f"--coordinator {one!r}: expected HOST:PORT with the coordinator's port (its "
                                 "--listen port, 29400 by default)")
            hosts.append(host)
        if not hosts:
            raise UsageError(f"--coordinator {args.coordinator!r}: expected HOST:PORT[,HOST:PORT...]")
        return Rendezvous(coordinator=args.coordinator, listen="", endpoint=args.coordinator,
                          **{**common, "multi_node": hi > 1 or not all(is_loopback(h) for h in hosts)})
    if args.standalone:
        if hi > 1:
            raise UsageError(f"--standalone is for one node; drop --nnodes {args.nnodes} or use --rdzv-endpoint")
        if args.rdzv_endpoint:
            log.warning("--standalone: ignoring --rdzv-endpoint %s (torchrun does the same)", args.rdzv_endpoint)
        return Rendezvous(coordinator=None, listen=listen_flag or "127.0.0.1:0", **common)
    if backend == "c10d" and args.rdzv_endpoint:
        host, port = split_endpoint(args.rdzv_endpoint, C10D_DEFAULT_PORT, "--rdzv-endpoint")
        target = join_endpoint(host, port)
        common["endpoint"] = target
        if is_host is None:
            # torchrun's c10d backend: the agent on the endpoint's host serves; a second agent on that host
            # finds the port taken and joins (also when both tried at once: join_if_taken).
            if is_local_host(host) and _port_free(host, port):
                return Rendezvous(coordinator=None, listen=listen_flag or target, join_if_taken=True,
                                  bind="" if listen_flag else embed_bind(host, port, hi > 1), **common)
            return Rendezvous(coordinator=target, listen="", **common)
        if is_host:
            return Rendezvous(coordinator=None, listen=listen_flag or target,
                              bind="" if listen_flag else embed_bind(host, port, hi > 1), **common)
        return Rendezvous(coordinator=target, listen="", **common)
    if backend == "c10d" and hi > 1:
        raise UsageError("--rdzv-backend c10d with more than one node needs --rdzv-endpoint HOST:PORT")
    if hi > 1:
        port = args.master_port if args.master_port is not None else STATIC_DEFAULT_PORT
        # torchrun's static backend takes --rdzv-endpoint over --master-addr/--master-port when given
        # (torch.distributed.run.get_rdzv_endpoint); ignoring it sent node rank 1 to 127.0.0.1:29500.
        host = args.master_addr
        if args.rdzv_endpoint:
            host, port = split_endpoint(args.rdzv_endpoint, port, "--rdzv-endpoint")
        target = join_endpoint(host, port)
        common["endpoint"] = target
        common["static_rank"] = args.node_rank
        if args.node_rank >= hi:
            raise UsageError(f"--node-rank {args.node_rank}: expected 0..{hi - 1} for --nnodes {args.nnodes}")
        if args.node_rank == 0:
            return Rendezvous(coordinator=None, listen=listen_flag or target,
                              bind="" if listen_flag else embed_bind(host, port, True), **common)
        return Rendezvous(coordinator=target, listen="", **common)
    return Rendezvous(coordinator=None, listen=listen_flag or "127.0.0.1:0", **common)


def default_address(rdzv: Rendezvous, explicit: str | None) -> str:
    """The address peers reach this node at: ``explicit``, else 127.0.0.1 on one node, else the local address
    of the route to the coordinator (found with a UDP ``connect``, which sends nothing) unless that is loopback
    (the coordinator's host name means this host), else the host name.

    A loopback address in a multi-node job is warned about: other nodes could not reach this node's store.
    """
    if explicit:
        if rdzv.multi_node and is_loopback(explicit):
            log.warning("--address/--local-addr %s is a loopback address in a multi-node job: other nodes cannot "
                        "reach this node; give an address they can route to", explicit)
        return explicit
    if not rdzv.multi_node:
        return "127.0.0.1"
    peer = _first_address(rdzv.coordinator or rdzv.listen)
    host, port = split_endpoint(peer, 0, "--coordinator")
    if not is_loopback(host) and host not in ("0.0.0.0", "::"):
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((host, port or 9))
                mine = s.getsockname()[0]
            if not is_loopback(mine):
                return mine
            # The coordinator's name means loopback here (Debian's 127.0.1.1 for the host's own name), not on
            # the other nodes: 127.0.0.1 as this node's address (MASTER_ADDR when it holds rank 0) sent their
            # workers to themselves. The host name is what they resolve to this node, as torchrun's agent does.
        except OSError:
            pass
    if is_loopback(host):
        log.warning("multi-node job with the coordinator at loopback %s: this node's address defaults to "
                    "127.0.0.1, which other nodes cannot reach; pass --local-addr/--address", peer)
        return "127.0.0.1"
    return socket.getfqdn()


def parse_streams(text: str, flag: str, nproc: int) -> dict[int, int]:
    """torchrun's ``Std`` syntax: ``0``..``3`` for every local rank, or ``0:1,1:2`` per local rank -> rank -> bits
    (1 stdout, 2 stderr).

    Raises:
        UsageError: a value outside 0..3 or a malformed entry, naming ``flag``.
    """
    text = str(text).strip()

    def bits(v: str) -> int:
        if v not in ("0", "1", "2", "3"):
            raise UsageError(f"{flag} {text!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
                             "or LOCAL_RANK:VALUE pairs such as 0:1,1:2")
        return int(v)

    if ":" not in text:
        return {r: bits(text or "0") for r in range(nproc)}
    out = {r: 0 for r in range(nproc)}
    for item in text.split(","):
        rank, _, value = item.partition(":")
        try:
            r = int(rank)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {item!r} is not LOCAL_RANK:VALUE") from None
        out[r] = bits(value.strip())
    return out


def parse_ranks_filter(text: str) -> set[int] | None:
    """``--local-ranks-filter 0,2`` -> {0, 2}; empty -> None (no filter).

    Raises:
        UsageError: not a comma list of integers.
    """
    if not str(text).strip():
        return None
    try:
        return {int(x) for x in str(text).split(",")}
    except ValueError:
        raise UsageError(f"--local-ranks-filter {text!r}: expected a comma list of local ranks, e.g. 0,1") from None


def stream_specs(args: argparse.Namespace, nproc: int) -> dict[int, StreamSpec]:
    """Per local rank, where stdout and stderr go, from ``--log-dir``, ``-r``, ``-t`` and
    ``--local-ranks-filter`` (torchrun's semantics: files only for ``-r``, files and console for ``-t``; the
    filter only hides console output). ``-r``/``-t`` without ``--log-dir`` write into a new temporary folder,
    as torchrun's do (refused before, so a torchrun line with ``-t 3`` did not run unchanged): ``args.log_dir``
    is set to it, and a line says where it is.

    Raises:
        UsageError: bad values.
    """
    redirects = parse_streams(args.redirects, "--redirects", nproc)
    tee = parse_streams(args.tee, "--tee", nproc)
    shown = parse_ranks_filter(args.local_ranks_filter)
    if (any(redirects.values()) or any(tee.values())) and not args.log_dir:
        import tempfile

        args.log_dir = tempfile.mkdtemp(prefix="trainguard-logs-")
        log.warning("--redirects/--tee without --log-dir: the workers' log files go to %s", args.log_dir)
    specs = {}
    for r in range(nproc):
        kinds = []
        for bit in (1, 2):
            if tee[r] & bit:
                kind = "tee"
            elif redirects[r] & bit:
                kind = "file"
            else:
                kind = "console"
            if shown is not None and r not in shown:
                kind = {"tee": "file", "console": "null"}.get(kind, kind)
            kinds.append(kind)
        specs[r] = StreamSpec(*kinds)
    return specs


def parse_signals(text: str) -> tuple[signal.Signals, ...]:
    """``SIGTERM,SIGINT`` -> signals.

    Raises:
        UsageError: an unknown or uncatchable signal name.
    """
    out = []
    for name in filter(None, (s.strip().upper() for s in str(text).split(","))):
        full = name if name.startswith("SIG") else "SIG" + name
        try:
            sig = signal.Signals[full]
        except KeyError:
            raise UsageError(f"--signals-to-handle {text!r}: unknown signal {name!r}") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise UsageError(f"--signals-to-handle {text!r}: {full} cannot be handled")
        out.append(sig)
    return tuple(out)


def worker_command(args: argparse.Namespace) -> list[str]:
    """The worker's command line: ``python -u [-m] SCRIPT ARGS`` (``$PYTHON_EXEC`` as torchrun honours it), or
    ``SCRIPT ARGS`` with ``--no-python``.

    Raises:
        UsageError: ``--no-python`` with ``--module``, or a script that does not exist.
    """
    from trainguard.agent.workers import python_argv

    if args.no_python:
        if args.module:
            raise UsageError("--no-python and --module cannot be used together (torchrun refuses them too)")
        return [args.script, *args.script_args]
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"training script not found: {args.script}")
    return python_argv(args.script, args.script_args, module=args.module,
                       python=os.environ.get("PYTHON_EXEC") or None)


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """torchrun flags given that trainguard accepts but does not apply (logged once at start)."""
    out = []
    if args.start_method != "spawn":
        out.append(f"--start-method {args.start_method} (workers always start as fresh interpreters or standbys)")
    if args.event_log_handler != "null":
        out.append(f"--event-log-handler {args.event_log_handler}")
    for flag in ("duplicate_stdout_filters", "duplicate_stderr_filters", "logs_specs", "numa_binding"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    return out
