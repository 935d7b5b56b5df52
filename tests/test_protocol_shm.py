"""Arrays by reference through shared memory (wamkit.protocol.shm): the client's slots and the server's checks, then
a real `wamkit serve shm_arrays=true` answering wamkit's websocket client with the HTTP path's actions."""

from __future__ import annotations

import asyncio
import glob
import os

import numpy as np
import pytest

from wamkit.core.types import Observation
from wamkit.protocol import ProtocolError
from wamkit.protocol.openpi import packb, unpackb
from wamkit.protocol.shm import SHM_DIR, ShmReader, ShmSlots, available, refuse

pytestmark = pytest.mark.skipif(not available(), reason="needs a writable /dev/shm")

ARGS = {"base_ms": 1, "per_obs_ms": 0, "action_dim": 4, "horizon": 8}   # fixed-cost: chunks seeded by the seed


def _body(rng, n=3):
    imgs = [{"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)} for _ in range(n)]
    states = [rng.standard_normal(5).astype(np.float32) for _ in range(n)]
    return {"input": {"images": imgs, "state": states, "task": "t"}, "parameters": {"seed": list(range(n))}}


def test_slots_round_trip_into_the_servers_array_markers():
    """The server's resolved frame holds ordinary array markers over the same bytes the client packed."""
    rng = np.random.default_rng(0)
    body = _body(rng)
    slots, maps = ShmSlots(), ShmReader(1 << 24)
    try:
        frame, slot = slots.pack(body)
        assert len(frame) < 1000                     # references, not 3 x 3 KB of pixels
        got = maps.resolve(unpackb(frame))
        for i in range(3):
            m = got["input"]["images"][i]["image"]
            assert np.array_equal(np.frombuffer(m[b"data"], np.uint8).reshape(m[b"shape"]),
                                  body["input"]["images"][i]["image"])
            s = got["input"]["state"][i]
            assert np.array_equal(np.frombuffer(s[b"data"], np.dtype(s[b"dtype"])), body["input"]["state"][i])
        # answered: the slot is reused for the next request; a failed request's slot is dropped (file gone)
        slots.done(slot, True)
        frame2, slot2 = slots.pack(_body(rng))
        assert slot2 is slot
        slots.done(slot2, False)
        assert not os.path.exists(slot.path)
        _, slot3 = slots.pack(body)
        assert slot3 is not slot and os.path.exists(slot3.path)
    finally:
        slots.close()
    assert not os.path.exists(slot3.path)            # close unlinks every file


def test_a_slot_grows_by_a_new_file_when_requests_carry_more():
    rng = np.random.default_rng(1)
    slots = ShmSlots()
    try:
        _, small = slots.pack(_body(rng, 1))
        slots.done(small, True)
        big = {"input": {"images": [{"image": rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)}] * 4}}
        frame, slot = slots.pack(big)
        assert slot is not small and slot.size >= 4 * 256 * 256 * 3 and not os.path.exists(small.path)
        got = ShmReader(1 << 24).resolve(unpackb(frame))
        m = got["input"]["images"][3]["image"]
        assert bytes(m[b"data"]) == big["input"]["images"][3]["image"].tobytes()
    finally:
        slots.close()


def test_bad_references_are_refused_naming_the_field(tmp_path):
    rng = np.random.default_rng(2)
    slots, maps = ShmSlots(), ShmReader(1 << 20)
    try:
        frame, slot = slots.pack(_body(rng))
        body = unpackb(frame)
        ref = body["input"]["images"][1]["image"]

        def refused(change: dict, where: str):
            bad = unpackb(frame)
            bad["input"]["images"][1]["image"] = {**ref, **change}
            with pytest.raises(ProtocolError) as e:
                maps.resolve(bad)
            assert e.value.path.startswith("input.images[1].image" + where), e.value.path

        refused({"__shm__": "../etc/passwd"}, "")                      # not a slot name
        refused({"__shm__": "wamkit-shm-" + "0" * 24}, "")             # no such slot
        refused({"offset": slot.size}, "")                             # outside the file
        refused({"offset": -1}, ".offset")
        refused({"dtype": "|O"}, ".dtype")                             # no object arrays
        refused({"shape": [1 << 40]}, "")                              # more bytes than the file has
        refused({"shape": "32x32"}, ".shape")
        # a link with a slot's name is not followed; a file bigger than the cap is refused (413)
        link = os.path.join(SHM_DIR, "wamkit-shm-" + "1" * 24)
        os.symlink(slot.path, link)
        try:
            refused({"__shm__": os.path.basename(link)}, "")
        finally:
            os.unlink(link)
        with pytest.raises(ProtocolError) as e:
            ShmReader(16).resolve(body)
        assert e.value.status == 413
        # a server that takes no references says so, naming the field
        with pytest.raises(ProtocolError) as e:
            refuse(body)
        assert e.value.path == "input.images[0].image" and "shm_arrays=true" in str(e.value)
        refuse(unpackb(packb(_body(rng))))                             # inline arrays pass
    finally:
        slots.close()


def test_many_references_to_one_slot_are_refused_before_their_bytes_are_copied():
    """A probe's finding: a ~6 KB frame whose N image references all name one whole 32 MiB slot made the server
    copy N x 32 MiB (60 refs: 2.1 GB) before the decode budget refused it. The copies of one frame are now held to
    the server's max_decoded_mb: a 413 at the first reference past it, and an open-file count back where it was."""
    rng = np.random.default_rng(3)
    slots = ShmSlots()
    try:
        frame, _ = slots.pack(_body(rng))
        body = unpackb(frame)
        ref = body["input"]["images"][0]["image"]
        one = int(np.prod(ref["shape"])) * np.dtype(ref["dtype"]).itemsize
        body["input"]["images"] = [{"image": dict(ref)} for _ in range(10)]
        assert len(ShmReader(1 << 20, 10 * one + 60).resolve(body)["input"]["images"]) == 10   # + 3 states
        fds = _open_fds()
        with pytest.raises(ProtocolError) as e:
            ShmReader(1 << 20, 4 * one + one // 2).resolve(body)
        assert e.value.status == 413 and e.value.path == "input.images[4].image" and "max_decoded_mb" in str(e.value)
        assert _open_fds() == fds
    finally:
        slots.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_slot_the_client_changes_after_a_frame_is_read_anew_or_refused_never_kills_the_server():
    """The server copies each reference's bytes when the frame arrives and keeps no file open or mapped between
    frames. So: a slot the client shrank is a 400 (a read through a mapping past a file's end is SIGBUS: the whole
    server gone); a slot unlinked and created again under the same name is read from the new file (a cached mapping
    served the old bytes, NaN in the new file went through); a dropped slot's memory is not held by the server."""
    rng = np.random.default_rng(3)
    slots, reader = ShmSlots(), ShmReader(1 << 24)
    try:
        frame, slot = slots.pack(_body(rng))
        fds = _open_fds()
        first = reader.resolve(unpackb(frame))
        assert _open_fds() == fds                                       # the server holds no file after a frame
        # the client shrinks the file: the same frame again is refused, naming the field
        os.truncate(slot.path, 64)
        with pytest.raises(ProtocolError) as e:
            reader.resolve(unpackb(frame))
        assert e.value.path.startswith("input.") and "outside the slot" in str(e.value)
        # ... the bytes read before are the server's own copy: still what the client sent
        img = first["input"]["images"][2]["image"]
        assert bytes(img[b"data"]) == _body(np.random.default_rng(3))["input"]["images"][2]["image"].tobytes()
        # the file unlinked and created again under its name, now with a NaN state: the new bytes are what count
        slot.drop()
        body = _body(rng)
        body["input"]["state"][0][:] = np.nan
        fd = os.open(slot.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, slot.size)
        finally:
            os.close(fd)
        again = ShmSlots()
        try:
            again_slot = again.pack(_body(rng))[1]          # a real slot to pack into, then renamed to the old name
            os.rename(again_slot.path, slot.path)
            frame2 = again_slot.pack(body)
            got = reader.resolve(unpackb(frame2.replace(again_slot.name.encode(), slot.name.encode())))
            s = got["input"]["state"][0]
            assert np.isnan(np.frombuffer(s[b"data"], np.dtype(s[b"dtype"]))).all()
        finally:
            again.close()
    finally:
        slots.close()
        if os.path.exists(slot.path):
            os.unlink(slot.path)


def test_a_malformed_dtype_in_a_reference_is_a_400_naming_it():
    """numpy parses some dtype strings as Python ('f4,(' is a SyntaxError): each is a ProtocolError on .dtype."""
    slots = ShmSlots()
    try:
        frame, _ = slots.pack(_body(np.random.default_rng(4)))
        for bad in ("f4,(", "not-a-dtype", 7, None, ["<f4"]):
            body = unpackb(frame)
            body["input"]["state"][0]["dtype"] = bad
            with pytest.raises(ProtocolError) as e:
                ShmReader(1 << 24).resolve(body)
            assert e.value.path == "input.state[0].dtype" and e.value.status == 400, (bad, e.value.path)
    finally:
        slots.close()


def _obs(n: int, seed: int = 0) -> list[Observation]:
    rng = np.random.default_rng(seed)
    return [Observation({"image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)},
                        rng.standard_normal(6).astype(np.float32), f"task {i % 2}") for i in range(n)]


def test_a_server_with_shm_arrays_answers_the_http_paths_actions_and_keeps_serving():
    """`wamkit serve shm_arrays=true` and WebsocketActionClient(shm_arrays=True): the same actions as HTTP, frames
    of references only; a malformed reference is a 400 naming the field and the connection keeps serving; a
    client that did not ask sends inline arrays to the same server; nothing is left in /dev/shm."""
    from websockets.sync.client import connect

    from wamkit.serve import ActionClient, WamkitServerWorker
    from wamkit.serve.ws_client import WebsocketActionClient

    obs, seeds = _obs(6), [3, 4, 5, 6, 7, 8]
    # this test's own slots only (named for their creator's pid): other tests run beside it (make test's xdist
    # processes) and create slots of their own meanwhile
    mine = os.path.join(SHM_DIR, f"wamkit-shm-{os.getpid()}_*")
    before = set(glob.glob(mine))
    with WamkitServerWorker("fixed-cost", ARGS, max_batch_size=8, max_wait_ms=2,
                            extra_args={"shm_arrays": True}) as w:
        async def http():
            async with ActionClient(w.url) as c:
                return await c.predict(obs, seeds)

        async def ws(shm: bool):
            seen = []
            async with WebsocketActionClient(w.url, protocol="sglang-ws", shm_arrays=shm, on_timing=seen.append) as c:
                a = await c.predict(obs, seeds)
                b = await c.predict(obs[:2], seeds[:2])
                return a, b, c.shm_used, seen

        ref = asyncio.run(http())
        a, b, used, seen = asyncio.run(ws(True))
        assert used and np.array_equal(a, ref) and np.array_equal(b, ref[:2])
        assert all(t["request_bytes"] < 4096 for t in seen)           # 6 x 12 KB of pixels went by reference
        a2, _, used2, seen2 = asyncio.run(ws(False))
        assert not used2 and np.array_equal(a2, ref) and seen2[0]["request_bytes"] > 6 * 64 * 64 * 3

        slots = ShmSlots()
        try:
            frame, slot = slots.pack({"input": {"images": [{"image": o.images["image"]} for o in obs[:2]],
                                                "state": [o.state for o in obs[:2]], "task": "t"},
                                      "parameters": {"seed": [1, 2]}})
            bad = unpackb(frame)
            bad["input"]["images"][1]["image"]["offset"] = 1 << 40
            with connect(w.url.replace("http", "ws") + "/v1/actions/realtime", max_size=None) as conn:
                assert unpackb(conn.recv())["capabilities"]["shm_arrays"] is True
                conn.send(packb(bad))
                err = unpackb(conn.recv())["error"]
                assert err["code"] == 400 and err["path"] == "input.images[1].image"
                conn.send(frame)                                        # the same connection keeps serving
                reply = unpackb(conn.recv())
                assert len(reply["data"]) == 2 and "error" not in reply
        finally:
            slots.close()
    assert set(glob.glob(mine)) <= before


def test_a_server_without_shm_arrays_refuses_references_and_the_client_sends_inline():
    from websockets.sync.client import connect

    from wamkit.serve import WamkitServerWorker
    from wamkit.serve.ws_client import WebsocketActionClient

    obs = _obs(2)
    with WamkitServerWorker("fixed-cost", ARGS, max_batch_size=8, max_wait_ms=2) as w:
        async def ws():
            async with WebsocketActionClient(w.url, protocol="sglang-ws", shm_arrays=True) as c:
                return await c.predict(obs, [1, 2]), c.shm_used
        a, used = asyncio.run(ws())
        assert a.shape == (2, 8, 4) and not used                       # the server did not offer it
        slots = ShmSlots()
        try:
            frame, _ = slots.pack({"input": {"images": [{"image": o.images["image"]} for o in obs], "task": "t"}})
            with connect(w.url.replace("http", "ws") + "/v1/actions/realtime", max_size=None) as conn:
                assert unpackb(conn.recv())["capabilities"]["shm_arrays"] is False
                conn.send(frame)
                err = unpackb(conn.recv())["error"]
                assert err["code"] == 400 and err["path"] == "input.images[0].image"
        finally:
            slots.close()


def test_a_client_whose_slots_the_server_cannot_see_falls_back_to_inline_arrays(tmp_path, monkeypatch):
    """A server on another /dev/shm (a container sharing the host's loopback) answers 400 'cannot read' for a slot:
    the client resends that request with the arrays inline and sends inline from then on; nothing is lost."""
    import wamkit.protocol.shm as shm
    from wamkit.serve import ActionClient, WamkitServerWorker
    from wamkit.serve.ws_client import WebsocketActionClient

    obs, seeds = _obs(4, seed=5), [1, 2, 3, 4]
    with WamkitServerWorker("fixed-cost", ARGS, max_batch_size=8, max_wait_ms=2,
                            extra_args={"shm_arrays": True}) as w:
        async def http():
            async with ActionClient(w.url) as c:
                return await c.predict(obs, seeds)

        ref = asyncio.run(http())
        monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))       # this client's slots: where the server never looks
        packed = []
        pack = shm.ShmSlots.pack
        monkeypatch.setattr(shm.ShmSlots, "pack", lambda self, body: packed.append(1) or pack(self, body))

        async def ws():
            seen = []
            async with WebsocketActionClient(w.url, protocol="sglang-ws", shm_arrays=True, retries=0,
                                             on_timing=seen.append) as c:
                a = await c.predict(obs, seeds)
                b = await c.predict(obs, seeds)
                return a, b, c.shm_used, seen
        a, b, used, seen = asyncio.run(ws())
    assert np.array_equal(a, ref) and np.array_equal(b, ref) and not used
    assert packed == [1]                                            # tried once, refused, then inline
    assert all(t["request_bytes"] > 4 * 64 * 64 * 3 for t in seen)   # both went inline
    assert list(tmp_path.iterdir()) == []                           # the slots were removed


def test_a_client_that_starts_removes_the_slots_of_killed_clients_only():
    """A client killed with SIGKILL runs no atexit: its slots stayed in /dev/shm for good (12 such files were found
    on this machine). Slot names carry the client's pid; a new client unlinks the slots whose pid no longer runs,
    and leaves those of running clients."""
    import subprocess
    import sys

    code = ("import os, signal, numpy as np; from wamkit.protocol.shm import ShmSlots; s = ShmSlots(); "
            "f, slot = s.pack({'x': np.zeros(8, np.float32)}); print(slot.name, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    orphan = r.stdout.strip()
    assert r.returncode == -9 and orphan.startswith("wamkit-shm-") and os.path.exists(os.path.join(SHM_DIR, orphan))
    mine = ShmSlots()
    try:
        _, live = mine.pack({"x": np.zeros(8, np.float32)})
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))       # the killed client's slot is gone ...
        ShmSlots().close()                                             # ... and another client's start
        assert os.path.exists(live.path)                               # leaves a running client's slot alone
    finally:
        mine.close()
