"""launcher.transport on this machine and over a real sshd on loopback (tests/services/sshd.py):
the same operations, the same answers, one host-key policy."""

from __future__ import annotations

import pytest

from launcher.errors import UserError
from launcher.transport import ConnectError, Transport
from launcher.transport.lines import LineSplitter, iter_lines
from launcher.transport.local import LocalTransport
from tests.services.sshd import ssh_cluster  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


def test_line_splitter_holds_a_line_cut_across_chunks():
    s = LineSplitter()
    assert s.feed(b"one\ntw") == ["one"]
    assert s.feed(b"o\n\xff\nthr") == ["two", "\ufffd"]
    assert s.rest() == "thr" and s.rest() is None
    assert list(iter_lines([b"a\nb", b"c\n"])) == ["a", "bc"]
    assert list(iter_lines([b"a\n", b"b"])) == ["a", "b"]


def _ssh(c, **kw) -> Transport:
    from launcher.transport.ssh import SSHOptions, connect

    return connect("node01", SSHOptions(ssh_config=str(c.ssh_config), known_hosts=str(c.known_hosts),
                                        connect_timeout=5, **kw))


@pytest.fixture(params=["local", "ssh"])
def transport(request, tmp_path):
    if request.param == "local":
        t: Transport = LocalTransport()
    else:
        t = _ssh(request.getfixturevalue("ssh_cluster"))
    with t:
        yield t


def test_run_argv_command_line_cwd_and_stdin(transport, tmp_path):
    c = transport.run(["printf", "%s|", "a b", "it's", "x=1"], timeout=10)
    assert c.ok and c.stdout == "a b|it's|x=1|"
    c = transport.run("echo out; echo err >&2; exit 3", timeout=10)
    assert (c.rc, c.stdout, c.stderr.strip(), c.ok) == (3, "out\n", "err", False)
    assert transport.run(["pwd"], cwd=str(tmp_path), timeout=10).stdout.strip() == str(tmp_path)
    assert transport.run(["cat"], stdin=b"fed\n", timeout=10).stdout == "fed\n"
    assert transport.run(["cat"], timeout=10).stdout == ""  # stdin is closed: nothing waits for it
    missing = transport.run(["no-such-program-l4d"], timeout=10)
    assert missing.rc == 127 and "not found" in missing.stderr


def test_run_timeout_and_flood_are_stopped(transport):
    c = transport.run("sleep 30", timeout=1)
    assert c.timed_out and c.rc is None and not c.ok
    c = transport.run("yes", timeout=60, limit=1 << 16)
    assert c.flooded and c.rc is None and len(c.stdout) == 1 << 16
    assert transport.run(["echo", "after"], timeout=10).stdout == "after\n"  # still usable


def test_files_put_get_exists(transport, tmp_path):
    d = tmp_path / "a" / "b"
    transport.makedirs(str(d))
    assert transport.exists(str(d)) and not transport.exists(str(d / "f"))
    transport.put(str(d / "f"), "line1\nline2\n", 0o755)
    assert (d / "f").read_text() == "line1\nline2\n" and (d / "f").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in d.iterdir()) == ["f"]              # no temp file left behind
    assert transport.get(str(d / "f")) == b"line1\nline2\n"
    assert transport.get(str(d / "f"), 6) == b"line2\n"
    assert transport.get(str(d / "f"), 2, limit=3) == b"ne1"
    assert transport.get(str(d / "f"), 100) == b""
    assert transport.get(str(d / "nope")) is None and transport.get(str(d)) is None
    (d / "bin").write_bytes(b"\xff\x00\xfe")
    assert transport.get(str(d / "bin")) == b"\xff\x00\xfe"            # bytes as they are
    transport.remove_tree(str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    assert transport.which("bash") and not transport.which("no-such-program-l4d")
    assert transport.home().startswith("/")


def test_put_into_a_missing_directory_is_one_line(transport, tmp_path):
    with pytest.raises(UserError) as e:
        transport.put(str(tmp_path / "none" / "f"), "x")
    assert str(tmp_path / "none") in str(e.value) and "\n" not in str(e.value)


def test_stream_yields_lines_as_they_come(transport):
    it = transport.stream("echo one; sleep 0.3; printf 'two\\nthree'; sleep 30", timeout=20)
    assert next(it) == "one"
    assert next(it) == "two"
    it.close()  # ends the command: no sleeping process is left (the test would hang on ssh close otherwise)
    assert list(transport.stream(["printf", "a\\nb"], timeout=10)) == ["a", "b"]


# --- one host-key policy ---------------------------------------------------------------------
def test_unknown_host_key_refused_then_accepted_and_recorded(ssh_cluster, tmp_path):  # noqa: F811
    kh = tmp_path / "kh"
    kh.write_text("")
    with pytest.raises(ConnectError) as e:
        _connect(ssh_cluster, kh)
    assert e.value.kind == "unknown-host-key" and not e.value.transient and "refusing" in str(e.value)
    with _connect(ssh_cluster, kh, accept_new_hosts=True) as t:
        assert t.run(["true"]).ok
    port = ssh_cluster.nodes["node01"].port
    assert kh.read_text().startswith(f"[127.0.0.1]:{port} ssh-ed25519 ")
    with _connect(ssh_cluster, kh) as t:                                # now known: no opt-in needed
        assert t.run(["true"]).ok


def _connect(c, kh, **kw):
    from launcher.transport.ssh import SSHOptions, connect

    return connect("node01", SSHOptions(ssh_config=str(c.ssh_config), known_hosts=str(kh), connect_timeout=5, **kw))


def test_changed_host_key_refused_even_when_accepting_new(ssh_cluster, tmp_path):  # noqa: F811
    from tests.services.sshd import keygen

    keygen(tmp_path / "other")
    ktype, key = (tmp_path / "other.pub").read_text().split()[:2]
    kh = tmp_path / "kh"
    kh.write_text(f"[127.0.0.1]:{ssh_cluster.nodes['node01'].port} {ktype} {key}\n")
    with pytest.raises(ConnectError) as e:
        _connect(ssh_cluster, kh, accept_new_hosts=True)
    assert e.value.kind == "changed-host-key" and "does not match" in str(e.value)


def test_refused_port_is_transient(ssh_cluster, tmp_path):  # noqa: F811
    from launcher.transport.ssh import SSHOptions, connect

    with pytest.raises(ConnectError) as e:
        connect("127.0.0.1", SSHOptions(port=1, known_hosts=str(ssh_cluster.known_hosts), connect_timeout=3))
    assert e.value.transient and "connection refused" in str(e.value)
