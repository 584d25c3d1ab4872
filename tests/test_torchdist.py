"""gloo:// groups for real: broadcast down, gather up, beside a trainer's own default group, and failures.

Multi-process tests spawn real ranks; the rest form the group with threads of
this process (gloo groups do not care), which keeps the file fast.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time

import pytest
import xxhash

from helpers import free_port, random_bytes

torch = pytest.importorskip("torch")

from wsync.errors import ChecksumError, TransportError  # noqa: E402
from wsync.transports import Message, TransportTimeout, connect, listen  # noqa: E402
from wsync.transports import envelope  # noqa: E402
from wsync.transports import groupframe as gf  # noqa: E402
from wsync.transports.options import parse_size  # noqa: E402


def _group(n_subs: int, **opts):
    """Publisher link + subscriber links, the subscribers joining from threads."""
    lst = listen(f"gloo://127.0.0.1:0?world_size={n_subs + 1}", **opts)
    subs, errs = [None] * n_subs, []

    def join(i):
        try:
            subs[i] = connect(lst.address, rank=i + 1, **opts)
        except Exception as e:  # surfaced below
            errs.append(e)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(n_subs)]
    [t.start() for t in threads]
    pub = lst.accept(timeout=60)
    [t.join() for t in threads]
    assert not errs and pub is not None
    return lst, pub, subs


def _in_thread(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=_catch(fn, *args)))
    t.start()
    return t, out


def _catch(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


# -- pure pieces ------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, chunk, expected", [
    ([], 4, []),
    ([0, 0], 4, []),
    ([3], 4, [[(0, 0, 3)]]),
    ([4], 4, [[(0, 0, 4)]]),
    ([9], 4, [[(0, 0, 4)], [(0, 4, 4)], [(0, 8, 1)]]),
    ([1, 2, 1, 3], 4, [[(0, 0, 1), (1, 0, 2), (2, 0, 1)], [(3, 0, 3)]]),
    ([1, 6, 1], 4, [[(0, 0, 1)], [(1, 0, 4)], [(1, 4, 2)], [(2, 0, 1)]]),
    ([2, 0, 2], 4, [[(0, 0, 2), (2, 0, 2)]]),
])
def test_plan_pieces(sizes, chunk, expected):
    assert gf.plan_pieces(sizes, chunk) == expected


@pytest.mark.parametrize("text, n", [("1048576", 1 << 20), ("64M", 64 << 20), ("1G", 1 << 30), ("2KiB", 2048), (7, 7), ("1.5M", 3 << 19)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12X", "-1", "M", -3])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_parse_head_rejects_garbage():
    good, _ = gf.pack_head(Message("k", {"a": 1}, [b"xy"]), 16)
    h = gf.parse_head(good)
    assert (h.kind, h.meta, h.sizes, h.chunk, h.device) == ("k", {"a": 1}, [2], 16, [])
    flipped = bytearray(good)
    flipped[-3] ^= 1
    with pytest.raises(ChecksumError):
        gf.parse_head(bytes(flipped))
    with pytest.raises(TransportError, match="not a wsync message"):
        gf.parse_head(b"XXXX" + good[4:])
    with pytest.raises(TransportError):
        gf.parse_head(good[:10])
    with pytest.raises(TransportError):
        envelope.check_length(1 << 40)


def test_bad_addresses_and_options():
    with pytest.raises(ValueError, match="world_size"):
        listen("gloo://127.0.0.1:0")
    with pytest.raises(ValueError, match="unknown option"):
        listen("gloo://127.0.0.1:0?world_size=2&colour=red")
    with pytest.raises(ValueError, match="expected int"):
        listen("gloo://127.0.0.1:0?world_size=two")
    with pytest.raises(TransportError, match="cannot reach"):
        connect(f"gloo://127.0.0.1:{free_port()}", join_timeout=0.5)


# -- groups in threads ------------------------------------------------------------------


def test_lockstep_round_trip_timeouts_and_ranks():
    lst, pub, (s1, s2) = _group(2, chunk="64K")
    assert pub.fanout == 2 and s1.fanout == 1
    with pytest.raises(TransportTimeout):  # nothing published yet; the wait stays resumable
        s1.recv(timeout=0.2)
    blobs = [b"abc", b"", random_bytes(1, 300_001), bytearray(b"x" * 100), memoryview(random_bytes(2, 70_000))]
    t1, r1 = _in_thread(s1.recv, 30)
    t2, r2 = _in_thread(s2.recv, 30)
    pub.send(Message("bucket", {"version": 3}, blobs))
    t1.join(), t2.join()
    for r in (r1["r"], r2["r"]):
        assert r.kind == "bucket" and r.meta == {"version": 3}
        assert [bytes(b) for b in r.blobs] == [bytes(memoryview(b).cast("B")) for b in blobs]
    with pytest.raises(TransportTimeout):  # no replies yet
        pub.recv(timeout=0.2)
    t1, _ = _in_thread(s1.send, Message("ack", {"ok": True}, [b"one"]))
    t2, _ = _in_thread(s2.send, Message("ack", {"ok": False}, [random_bytes(3, 200_000)]))
    first, second = pub.recv(timeout=30), pub.recv(timeout=30)
    t1.join(), t2.join()
    assert (first.meta, bytes(first.blobs[0])) == ({"ok": True, "rank": 1}, b"one")
    assert second.meta == {"ok": False, "rank": 2} and bytes(second.blobs[0]) == random_bytes(3, 200_000).tobytes()
    t1, r1 = _in_thread(s1.recv, 30)
    t2, r2 = _in_thread(s2.recv, 30)
    pub.send(Message("empty"))
    t1.join(), t2.join()
    assert r1["r"].kind == r2["r"].kind == "empty" and r1["r"].blobs == []
    for link in (pub, s1, s2):
        link.close()
    lst.close()


def test_rank_claims_and_generations():
    """Ranks are claimed per generation; once a group forms, the next subscribers form the next one."""
    lst = listen("gloo://127.0.0.1:0?world_size=3")
    t1, r1 = _in_thread(lambda: connect(lst.address, rank=1))
    while not lst.store.check(["g0/rank/1"]):
        pass
    with pytest.raises(TransportError, match="already taken"):
        connect(lst.address, rank=1)  # generation 0 is forming and rank 1 is claimed
    with pytest.raises(TransportError, match="world_size=5"):
        connect(lst.address, world_size=5)
    assert lst.accept(timeout=0.1) is None  # one of two subscribers: not formed
    t2, r2 = _in_thread(lambda: connect(lst.address))  # the next free rank: 2
    first = lst.accept(timeout=60)
    t1.join(), t2.join()
    assert (first.rank, r1["r"].rank, r2["r"].rank) == (0, 1, 2) and first.fanout == 2
    # the first group is whole; two more subscribers form a second group, beside it, on the same address
    t3, r3 = _in_thread(lambda: connect(lst.address, rank=1))
    t4, r4 = _in_thread(lambda: connect(lst.address, rank=2))
    second = lst.accept(timeout=60)
    t3.join(), t4.join()
    assert second is not None and "#1" in second.peer and "#0" in first.peer
    # each group carries its own messages
    pay0, pay1 = random_bytes(1, 1000), random_bytes(2, 3000)
    got = [_in_thread(link.recv, 30) for link in (r1["r"], r2["r"], r3["r"], r4["r"])]
    first.send(Message("bucket", {"g": 0}, [pay0]))
    second.send(Message("bucket", {"g": 1}, [pay1]))
    [t.join() for t, _ in got]
    for (_, out), (g, pay) in zip(got, [(0, pay0), (0, pay0), (1, pay1), (1, pay1)]):
        assert out["r"].meta == {"g": g} and bytes(out["r"].blobs[0]) == pay.tobytes()
    for link in (first, second, r1["r"], r2["r"], r3["r"], r4["r"]):
        link.close()


def test_a_join_that_cannot_form_abandons_its_generation():
    """A subscriber whose group never forms (here: the publisher never accepts) gives that generation up, so
    the next dial starts a fresh one instead of finding its ranks taken."""
    lst = listen("gloo://127.0.0.1:0?world_size=2", join_timeout=2)
    with pytest.raises(TransportError, match="forming the gloo group"):
        connect(lst.address, join_timeout=2)
    assert lst.store.get("g0/fate") == b"abandoned" and lst.store.get("gen") == b"1"
    assert lst.accept(timeout=0.1) is None  # generation 0 is not formed late
    t, r = _in_thread(lambda: connect(lst.address, rank=1, join_timeout=30))
    pub = lst.accept(timeout=30)
    t.join()
    assert pub is not None and r["r"].rank == 1 and "#1" in pub.peer
    pub.close(), r["r"].close()


def test_out_of_step_group_fails_loudly():
    lst, pub, (sub,) = _group(1)
    t, r = _in_thread(sub.send, Message("ack"))
    with pytest.raises(TransportError, match="out of step"):
        pub.send(Message("bucket", {}, [b"zz"]))
    t.join()
    assert isinstance(r["r"], TransportError) and "out of step" in str(r["r"])
    with pytest.raises(TransportError, match="unusable"):
        pub.send(Message("again"))
    pub.close(), sub.close()


class FlipWire(gf.HostWire):
    """Corrupts one byte of the second piece on its way out (after the sender hashed the original)."""

    def __init__(self):
        self.n = 0

    def outgoing(self, t, slot):
        self.n += 1
        if self.n != 2:
            return t
        bad = t.clone()
        bad[5] ^= 0xFF
        return bad


def test_corrupt_piece_is_detected():
    lst, pub, (sub,) = _group(1, chunk="4K")
    pub.wire = FlipWire()
    t, r = _in_thread(sub.recv, 30)
    pub.send(Message("bucket", {}, [random_bytes(4, 20_000)]))
    t.join()
    assert isinstance(r["r"], ChecksumError) and "piece 1" in str(r["r"])
    pub.close(), sub.close()


def _kept(obj) -> bool:
    from wsync.transports import grouplink

    return any(x is obj for x in grouplink._KEPT)


def _close_from_another_thread(link) -> None:
    t = threading.Thread(target=link.close)
    t.start(), t.join()


def test_close_racing_a_recv_starts_nothing():
    """A close() that lands between a recv's check and its first operation: the recv posts nothing and raises,
    since a step posted on a group nobody keeps blocks whichever thread drops the group last."""
    lst, pub, (s1, s2) = _group(2)
    check = s1._usable

    def check_then_closed():
        check()
        _close_from_another_thread(s1)

    s1._usable = check_then_closed
    with pytest.raises(TransportError, match="closed"):
        s1.recv(timeout=0.2)
    assert s1._pending is None and not _kept(s1.ctrl)  # nothing in flight: its group may go
    with pytest.raises(TransportTimeout):  # s2 idles in its first step, which stays pending
        s2.recv(timeout=0.2)
    s2.close()
    assert _kept(s2.ctrl)  # so its group is held for the process's life, never destroyed under it
    with pytest.raises(TransportError, match="unusable"):
        s2.recv(timeout=0.2)
    pub.close(), lst.close()


class CloseMidMessage(gf.HostWire):
    """Closes its link (from another thread, as Subscriber.close does) when the first piece lands."""

    def __init__(self):
        self.link, self.n = None, 0

    def landed(self, t, slot):
        self.n += 1
        if self.n == 1:
            _close_from_another_thread(self.link)
        return super().landed(t, slot)


def test_close_mid_message_ends_the_wait_and_keeps_the_group():
    """A message under way when close() lands is abandoned at its next wait (within a slice, not the stall
    timeout); what it posted is kept with its groups; the next message does not start."""
    lst, pub, (sub,) = _group(1, chunk="4K", stall_timeout=600)
    sub.wire = CloseMidMessage()
    sub.wire.link = sub
    t, r = _in_thread(sub.recv, 600)
    sender, sent = _in_thread(pub.send, Message("bucket", {"v": 1}, [random_bytes(5, 200_000)]))
    t.join(timeout=30)
    assert not t.is_alive(), "close() left the receiving thread waiting"
    assert isinstance(r["r"], TransportError) and "closed" in str(r["r"]), r["r"]
    assert 1 <= sub.wire.n < 49 and _kept(sub.ctrl)
    with pytest.raises(TransportError, match="unusable"):
        sub.recv(timeout=0.2)
    pub.close()  # the publisher's send, stalled on the pieces nobody takes, ends too
    sender.join(timeout=30)
    assert not sender.is_alive() and isinstance(sent["r"], TransportError), sent
    lst.close()


def test_close_wakes_a_recv_that_waits_without_a_timeout():
    """recv(timeout=None) (how a publisher gathers acks) ends with "closed" once its link is closed from
    another thread, so the thread that waited can be joined."""
    for side in (0, 1):  # a group each: the first one's pending step would pair with the second's
        lst, pub, (sub,) = _group(1)
        link = (pub, sub)[side]
        t, r = _in_thread(link.recv, None)
        deadline = time.monotonic() + 30
        while link._pending is None:  # its first step posted: it waits in it from here
            assert time.monotonic() < deadline and t.is_alive(), r
            time.sleep(0.005)
        assert t.is_alive(), r
        link.close()
        t.join(timeout=30)
        assert not t.is_alive() and isinstance(r["r"], TransportError) and "closed" in str(r["r"]), r
        assert _kept(link.ctrl)
        (sub, pub)[side].close(), lst.close()


# -- real processes ---------------------------------------------------------------------


def _subscriber(address: str, rounds: int, use_default_group: int, q) -> None:
    try:
        import torch.distributed as dist

        if use_default_group:  # a trainer's own world, before and after ours
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{use_default_group}", rank=1, world_size=2)
            before = dict(dist.distributed_c10d._world.pg_map)
        link = connect(address)
        for i in range(rounds):
            m = link.recv(timeout=60)
            link.send(Message("ack", {"digest": xxhash.xxh3_64_hexdigest(m.blobs[0]), "i": i}, [m.blobs[1]]))
        if use_default_group:
            x = torch.ones(4) * (link.rank + 1)
            dist.all_reduce(x)
            assert x.tolist() == [3.0] * 4, x
            assert dict(dist.distributed_c10d._world.pg_map) == before and dist.get_world_size() == 2
            dist.destroy_process_group()
        link.close()
        q.put(("ok", link.rank))
    except BaseException as e:
        q.put(("error", repr(e)))
        raise


@pytest.mark.slow
def test_broadcast_large_messages_to_processes():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    lst = listen("gloo://127.0.0.1:0?world_size=3&chunk=4M")
    procs = [ctx.Process(target=_subscriber, args=(lst.address, 2, 0, q)) for _ in range(2)]
    [p.start() for p in procs]
    try:
        pub = lst.accept(timeout=120)
        assert pub is not None and pub.fanout == 2
        for i in range(2):
            big = random_bytes(10 + i, (9 << 20) + 12_345)  # several pieces plus a tail
            pub.send(Message("bucket", {"i": i}, [big, f"tail{i}".encode()]))
            replies = [pub.recv(timeout=60) for _ in range(2)]
            assert sorted(r.meta["rank"] for r in replies) == [1, 2]
            for r in replies:
                assert r.meta["digest"] == xxhash.xxh3_64_hexdigest(big) and r.meta["i"] == i
                assert bytes(r.blobs[0]) == f"tail{i}".encode()
        results = sorted(q.get(timeout=60) for _ in range(2))
        assert results == [("ok", 1), ("ok", 2)]
        pub.close()
    finally:
        [p.join(timeout=30) for p in procs]
        [p.kill() for p in procs if p.is_alive()]


def _trainer_rank0(address: str, port: int, q) -> None:
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        lst = listen(address)
        pub = lst.accept(timeout=120)
        payload = random_bytes(20, 3 << 20)
        pub.send(Message("bucket", {}, [payload, b"reply-me"]))
        r = pub.recv(timeout=60)
        assert r.meta["digest"] == xxhash.xxh3_64_hexdigest(payload) and bytes(r.blobs[0]) == b"reply-me"
        x = torch.ones(4)
        dist.all_reduce(x)
        assert x.tolist() == [3.0] * 4
        dist.destroy_process_group()
        pub.close()
        q.put(("ok", 0))
    except BaseException as e:
        q.put(("error", repr(e)))
        raise


@pytest.mark.slow
def test_coexists_with_a_default_process_group():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world, ours = free_port(), free_port()
    address = f"gloo://127.0.0.1:{ours}?world_size=2"
    procs = [ctx.Process(target=_trainer_rank0, args=(address, world, q)),
             ctx.Process(target=_subscriber, args=(address, 1, world, q))]
    [p.start() for p in procs]
    try:
        assert sorted(q.get(timeout=120) for _ in procs) == [("ok", 0), ("ok", 1)]
    finally:
        [p.join(timeout=30) for p in procs]
        [p.kill() for p in procs if p.is_alive()]


def _join_then_die(address: str) -> None:
    connect(address)
    os._exit(3)


def test_dead_subscriber_is_a_transport_error():
    ctx = mp.get_context("spawn")
    lst = listen("gloo://127.0.0.1:0?world_size=2", stall_timeout=30)
    p = ctx.Process(target=_join_then_die, args=(lst.address,))
    p.start()
    pub = lst.accept(timeout=120)
    p.join(timeout=60)
    with pytest.raises(TransportError):
        pub.send(Message("bucket", {}, [random_bytes(5, 1 << 20)]))
    with pytest.raises(TransportError, match="unusable"):
        pub.recv(timeout=1)
    pub.close()


def _nccl_subscriber(address: str, q) -> None:
    try:
        link = connect(address, device="cuda:1")
        m = link.recv(timeout=120)
        link.send(Message("ack", {"digest": xxhash.xxh3_64_hexdigest(m.blobs[0])}, [m.blobs[1]]))
        link.close()
        q.put(("ok", 1))
    except BaseException as e:
        q.put(("error", repr(e)))
        raise


@pytest.mark.gpu
def test_nccl_group_moves_host_bytes_through_the_gpu():
    # NCCL wants one GPU per rank, so this needs two.
    if not hasattr(torch.distributed, "ProcessGroupNCCL") or torch.cuda.device_count() < 2:
        pytest.skip("nccl:// test needs a CUDA build of torch and two GPUs (one per rank)")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    lst = listen("nccl://127.0.0.1:0?world_size=2&chunk=1M", device="cuda:0")
    p = ctx.Process(target=_nccl_subscriber, args=(lst.address, q))
    p.start()
    try:
        pub = lst.accept(timeout=120)
        big = random_bytes(6, (5 << 20) + 3)
        pub.send(Message("bucket", {"v": 1}, [big, b"small"]))
        r = pub.recv(timeout=120)
        assert r.meta == {"digest": xxhash.xxh3_64_hexdigest(big), "rank": 1} and bytes(r.blobs[0]) == b"small"
        assert q.get(timeout=60) == ("ok", 1)
        pub.close()
    finally:
        p.join(timeout=60)
        p.kill() if p.is_alive() else None


def _follower(address: str, start: int, stop: int, q) -> None:
    """A Subscriber over gloo (world_size=2: a group of its own) reporting each version's digest."""
    import wsync
    from wsync import engines

    sub = wsync.Subscriber(address, engine=engines.Shadow())
    try:
        for v in range(start, stop):
            sub.wait_for(v, timeout=120)
            q.put((sub.version, sub.engine.digest()))
    except BaseException as e:
        q.put(("error", repr(e)))
        raise
    finally:
        sub.close()


class _SlowFinalizer:
    """Held by a module global, so its __del__ runs while the interpreter finalizes, and keeps it there for
    longer than the subscriber's idle wait (a second): a thread still inside that wait wakes up meanwhile."""

    def __del__(self):
        time.sleep(2.5)


def _left_open(address: str, q) -> None:
    """A Subscriber that follows one version and is never closed: the process just ends."""
    import wsync
    from wsync import engines

    global _HELD
    sub = wsync.Subscriber(address, engine=engines.Shadow())
    sub.wait_for(0, timeout=120)
    q.put(sub.version)
    _HELD = (sub, _SlowFinalizer())


def test_a_process_that_ends_with_a_gloo_subscriber_open_exits_cleanly():
    """Its receiving thread idles in a gloo wait with the GIL released; if the interpreter began finalizing
    before that thread was stopped, the thread's return from the wait would abort the process (SIGABRT)."""
    from wsync import Publisher

    ctx = mp.get_context("spawn")
    with Publisher("gloo://127.0.0.1:0?world_size=2&join_timeout=60") as pub:
        q = ctx.Queue()
        p = ctx.Process(target=_left_open, args=(pub.address, q))
        p.start()
        try:
            pub.wait_for_subscribers(1, timeout=120)
            pub.publish({"w": torch.arange(1000, dtype=torch.float32)}, version=0)
            assert q.get(timeout=120) == 0
            p.join(60)
            assert p.exitcode == 0, p.exitcode
        finally:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.mark.slow
def test_publisher_over_gloo_pairs_and_a_killed_subscriber_rejoins():
    """world_size=2: each subscriber process forms a group of its own with the Publisher (a pair, point to point,
    in lockstep). One is killed; a new process dials the same address, forms the next generation's group and
    takes a keyframe, while the other pair never stops. Every version's digest equals the publisher's state, and
    every subscriber process exits (a closed group whose collective is pending would hang in its destructor)."""
    from wsync import Publisher
    from wsync.snapshot import as_state, digest

    ctx = mp.get_context("spawn")
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(64, 256 + i, generator=gen).to(torch.bfloat16) for i in range(3)}
    procs, queues = {}, {}  # a queue each: a process killed while it writes to a shared one can wedge the rest

    def start(name, first, stop):
        queues[name] = ctx.Queue()
        procs[name] = ctx.Process(target=_follower, args=(pub.address, first, stop, queues[name]))
        procs[name].start()

    with Publisher("gloo://127.0.0.1:0?world_size=2&stall_timeout=30&join_timeout=60", keyframe_every=50) as pub:
        start("a", 0, 3)  # killed after version 2
        start("c", 0, 6)
        try:
            pub.wait_for_subscribers(2, timeout=120)
            for v in range(6):
                for t in state.values():  # ~1% of the values move
                    idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=gen)
                    t.view(-1)[idx] += 0.01
                pub.publish(state, version=v)
                want = digest(as_state(state))
                if v == 3:
                    start("b", 3, 6)
                for name in ("a", "c") if v < 3 else ("b", "c"):
                    assert queues[name].get(timeout=180) == (v, want), (name, v)
                if v == 2:
                    procs["a"].kill()  # its group breaks; the pair with c goes on
                    procs["a"].join(30)
            for name in ("b", "c"):
                procs[name].join(60)
                assert procs[name].exitcode == 0, (name, procs[name].exitcode)
        finally:
            for p in procs.values():
                if p.is_alive():
                    p.kill()
                p.join(10)
