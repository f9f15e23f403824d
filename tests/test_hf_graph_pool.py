"""DecodeGraphs' use of a shared graph pool, on the CPU with stand-ins for torch's graph API that keep the CUDA
caching allocator's rule: a pool that captured graphs used and that no graph uses any more takes no new capture."""

import torch

from exl3moe.hf import graphs


class FakePools:
    def __init__(self):
        self.users, self.handles = {}, 0

    def handle(self):
        self.handles += 1
        return ("pool", self.handles)

    def enter(self, pool):
        if self.users.get(pool, None) == 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        self.users[pool] = self.users.get(pool, 0) + 1


def install(monkeypatch):
    pools = FakePools()

    class FakeGraph:
        def __init__(self):
            self.pool = None

        def replay(self):
            pass

        def __del__(self):
            if self.pool is not None:
                pools.users[self.pool] -= 1

    class FakeCapture:
        def __init__(self, graph, pool):
            self.graph, self.pool = graph, pool

        def __enter__(self):
            pools.enter(self.pool)
            self.graph.pool = self.pool

        def __exit__(self, *exc):
            return False

    class FakeStream:
        def wait_stream(self, other):
            pass

    class NoContext:
        def __init__(self, *args):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", pools.handle)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", NoContext)
    return pools


class Step(dict):
    pass


def model(**kwargs):
    return Step(logits=kwargs["input_ids"].float())


def test_a_new_cache_is_captured_again_into_the_shared_pool(monkeypatch):
    pools = install(monkeypatch)
    monkeypatch.setattr(graphs, "capturable", lambda kwargs: True)
    monkeypatch.setattr(graphs, "step_key", lambda kwargs: ("one layout", kwargs["cache"]))
    runner = graphs.DecodeGraphs(model)
    ids = torch.ones(1, 1, dtype=torch.long)
    for cache in ("first cache", "second cache", "third cache"):   # generate() makes a new cache per call
        for _ in range(3):                                         # a capture, then replays
            runner(input_ids=ids, cache=cache)
    assert runner.failed == {}, runner.failed
    assert (runner.captures, runner.replays, len(runner.graphs)) == (3, 6, 1)
    assert list(pools.users.values()) == [1], "the stale graphs were released, the live one holds the pool"


def test_a_capture_after_every_graph_is_gone_takes_a_new_pool(monkeypatch):
    pools = install(monkeypatch)
    runner = graphs.DecodeGraphs(model)
    ids = torch.ones(1, 1, dtype=torch.long)
    runner._run_and_capture(("a",), "cache", {"input_ids": ids})
    runner.graphs.clear()                                  # every graph dropped (evicted or reset)
    runner._run_and_capture(("b",), "cache", {"input_ids": ids})
    assert runner.failed == {} and runner.captures == 2 and pools.handles == 2
