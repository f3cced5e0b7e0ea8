"""`ibstat` (infiniband-diags) and `ibv_devinfo` (rdma-core): HCA ports, state, rate, link layer.

ibstat prints, per CA, `CA 'mlx5_0'` then indented `Key: value` lines, with a `Port N:` block per
port (State, Physical state, Rate, ..., Link layer). ibv_devinfo prints `hca_id: mlx5_0` then
`port: N` blocks with `state: PORT_ACTIVE (4)`, `active_width: 4X (2)`, `active_speed: 100.0 Gbps
(64)`, `phys_state: LINK_UP (5)`, `link_layer: InfiniBand`. Both become the same dataclasses.
`ibstatus` prints `Infiniband device 'mlx5_0' port 1 status:` blocks (`state: 4: ACTIVE`,
`phys state: 5: LinkUp`, `rate: 200 Gb/sec (4X HDR)`, `link_layer: InfiniBand`): same dataclasses.
A port block without its state, physical state or rate means the output was cut: ParseError.
An adapter that vanishes while ibstat lists them (`ibpanic: ... stat of IB device 'mlx5_8' failed`,
exit 255) is recorded in `errors` and `missing`, keeping the adapters listed before it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from checks.parsers.base import ParseError, strip_ansi

KIND = "ibstat"
KV_RE = re.compile(r"^([A-Za-z][A-Za-z _-]*?)\s*:\s*(.*)$")


@dataclass
class IbPort:
    ca: str
    port: int
    state: str | None = None  # Active, Down, Initializing, Armed
    physical_state: str | None = None  # LinkUp, Polling, Disabled
    rate_gbps: float | None = None
    link_layer: str | None = None  # InfiniBand | Ethernet

    @property
    def active(self) -> bool:
        # plain `ibv_devinfo` (without -v) prints no physical state: the port state alone decides
        return (self.state or "").lower() == "active" and (self.physical_state or "linkup").lower() == "linkup"


@dataclass
class IbCa:
    name: str
    ca_type: str | None = None
    firmware: str | None = None
    ports: list[IbPort] = field(default_factory=list)


@dataclass
class IbStatus:
    cas: list[IbCa]
    errors: list[str] = field(default_factory=list)  # ibpanic lines
    missing: list[str] = field(default_factory=list)  # adapters ibstat could not read

    @property
    def unused_ethernet(self) -> list[IbPort]:
        """Ethernet ports switched off (Down / Disabled): unused NICs, not a broken rail."""
        return [p for p in self.ports if (p.link_layer or "").lower() == "ethernet"
                and (p.physical_state or "").lower() == "disabled"]

    @property
    def ports(self) -> list[IbPort]:
        return [p for ca in self.cas for p in ca.ports]

    def to_dict(self) -> dict[str, Any]:
        return {"cas": [{"name": c.name, "ca_type": c.ca_type, "firmware": c.firmware,
                         "ports": [{**vars(p), "active": p.active} for p in c.ports]} for c in self.cas],
                "errors": self.errors, "missing": self.missing,
                "unused_ethernet": [f"{p.ca}/{p.port}" for p in self.unused_ethernet]}


def _rate(v: str, line_no: int, line: str) -> float:
    m = re.match(r"^(\d+(?:\.\d+)?)", v.strip())
    if not m:
        raise ParseError(KIND, f"rate {v!r} is not a number", line_no, line)
    return float(m.group(1))


def _check_port(p: IbPort | None, line_no: int, line: str, brief: bool = False) -> None:
    """`brief`: plain ibv_devinfo, which prints no physical state, width or speed."""
    if p is None:
        return
    need = (("State", p.state), ("Link layer", p.link_layer)) if brief else (
        ("State", p.state), ("Physical state", p.physical_state), ("Rate", p.rate_gbps), ("Link layer", p.link_layer))
    missing = [n for n, v in need if v is None]
    if missing:
        raise ParseError(KIND, f"{p.ca} port {p.port}: {', '.join(missing)} missing (truncated?)", line_no, line)


@dataclass(frozen=True)
class _BlockFormat:
    """ibstat and ibstatus differ only in their header lines, key names and value spelling."""

    ca_re: re.Pattern[str] | None  # a line opening an adapter (ibstat); ibstatus names it on each port line
    port_re: re.Pattern[str]  # a line opening a port: groups `port` (and `ca` where the line names it)
    port_keys: dict[str, str]  # key -> IbPort field
    ca_keys: dict[str, str]  # key -> IbCa field, before the adapter's first port
    expected: str
    numbered: bool = False  # ibstatus writes `state: 4: ACTIVE`: the word after the number

    def value(self, attr: str, val: str) -> str:
        if not self.numbered or attr not in ("state", "physical_state"):
            return val
        word = val.split(":", 1)[-1].strip()
        return word.capitalize() if attr == "state" else word


IBSTATUS_RE = re.compile(r"^Infiniband device '(?P<ca>[^']+)' port (?P<port>\d+) status:$")
IBSTAT = _BlockFormat(re.compile(r"^CA '([^']+)'$"), re.compile(r"^Port (?P<port>\d+):$"),
                      {"state": "state", "physical state": "physical_state", "rate": "rate_gbps",
                       "link layer": "link_layer"},
                      {"ca type": "ca_type", "firmware version": "firmware"},
                      "expected \"CA 'name'\", 'Port N:' or 'Key: value'")
IBSTATUS = _BlockFormat(None, IBSTATUS_RE,
                        {"state": "state", "phys state": "physical_state", "rate": "rate_gbps",
                         "link_layer": "link_layer"}, {},
                        "expected \"Infiniband device '...' port N status:\" or 'key: value'", numbered=True)


def parse_ibstat(text: str) -> IbStatus:
    lines = strip_ansi(text).splitlines()
    if any(ln.strip().startswith("hca_id:") for ln in lines):
        return _parse_ibv_devinfo(lines)
    return _parse_blocks(lines, IBSTATUS if any(IBSTATUS_RE.match(ln.strip()) for ln in lines) else IBSTAT)


def _parse_blocks(lines: list[str], fmt: _BlockFormat) -> IbStatus:
    """ibstat and ibstatus: header lines open adapters and ports, `Key: value` lines fill them."""
    cas: dict[str, IbCa] = {}
    ca: IbCa | None = None
    errors: list[str] = []
    missing: list[str] = []
    port: IbPort | None = None
    last = (0, "")
    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            continue
        if s.startswith(("ibpanic:", "ibwarn:")):
            errors.append(s)
            mm = re.search(r"IB device '([^']+)'", s)
            if mm:
                missing.append(mm.group(1))
            continue
        m = fmt.ca_re.match(s) if fmt.ca_re else None
        if m:
            _check_port(port, *last)
            port = None
            ca = cas.setdefault(m.group(1), IbCa(name=m.group(1)))
            last = (i + 1, raw)
            continue
        m = fmt.port_re.match(s)
        if m:
            name = m.groupdict().get("ca") or (ca.name if ca else None)
            if name is None:
                raise ParseError(KIND, "Port block before any CA line", i + 1, raw)
            _check_port(port, *last)
            ca = cas.setdefault(name, IbCa(name=name))
            port = IbPort(ca=name, port=int(m.group("port")))
            ca.ports.append(port)
            last = (i + 1, raw)
            continue
        kv = KV_RE.match(s)
        if kv is None or ca is None or (port is None and not fmt.ca_keys):
            raise ParseError(KIND, fmt.expected, i + 1, raw)
        key, val = kv.group(1).strip().lower(), kv.group(2).strip()
        target, attr = (port, fmt.port_keys.get(key)) if port is not None else (ca, fmt.ca_keys.get(key))
        if attr == "rate_gbps":
            setattr(target, attr, _rate(val, i + 1, raw))
        elif attr:
            setattr(target, attr, fmt.value(attr, val))
        last = (i + 1, raw)
    _check_port(port, *last)
    if not cas and not errors:
        raise ParseError(KIND, "no \"CA '...'\" line: not ibstat output", 1, lines[0] if lines else "")
    return IbStatus(cas=list(cas.values()), errors=errors, missing=missing)


IBV_STATE = {"PORT_ACTIVE": "Active", "PORT_DOWN": "Down", "PORT_INIT": "Initializing", "PORT_ARMED": "Armed"}
IBV_PHYS = {"LINK_UP": "LinkUp", "POLLING": "Polling", "DISABLED": "Disabled", "SLEEP": "Sleep"}


def _parse_ibv_devinfo(lines: list[str]) -> IbStatus:
    cas: list[IbCa] = []
    port: IbPort | None = None
    width = speed = None
    last = (0, "")
    verbose = any(ln.strip().startswith("phys_state:") for ln in lines)

    def close() -> None:
        if port is not None and width is not None and speed is not None:
            port.rate_gbps = width * speed
        _check_port(port, *last, brief=not verbose)

    for i, raw in enumerate(lines):
        s = raw.strip()
        if not s:
            continue
        m = KV_RE.match(s)
        if not m:
            raise ParseError(KIND, "expected 'key: value'", i + 1, raw)
        key, val = m.group(1).strip().lower(), m.group(2).strip()
        if key == "hca_id":
            close()
            port, width, speed = None, None, None
            cas.append(IbCa(name=val))
        elif not cas:
            raise ParseError(KIND, "expected 'hca_id:' first", i + 1, raw)
        elif key == "port":
            close()
            if not val.isdigit():
                raise ParseError(KIND, f"port {val!r} is not a number", i + 1, raw)
            port, width, speed = IbPort(ca=cas[-1].name, port=int(val)), None, None
            cas[-1].ports.append(port)
        elif key == "fw_ver":
            cas[-1].firmware = val
        elif port is not None:
            word = val.split()[0] if val.split() else ""
            if key == "state":
                port.state = IBV_STATE.get(word, word)
            elif key == "phys_state":
                port.physical_state = IBV_PHYS.get(word, word)
            elif key == "link_layer":
                port.link_layer = val
            elif key == "active_width":
                mw = re.match(r"^(\d+)X", val)
                if not mw:
                    raise ParseError(KIND, f"active_width {val!r}", i + 1, raw)
                width = int(mw.group(1))
            elif key == "active_speed":
                ms = re.match(r"^(\d+(?:\.\d+)?)\s*Gbps", val)
                if not ms:
                    raise ParseError(KIND, f"active_speed {val!r}", i + 1, raw)
                speed = float(ms.group(1))
        last = (i + 1, raw)
    close()
    return IbStatus(cas=cas)
