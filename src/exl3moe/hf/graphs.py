"""CUDA-graph decode for transformers' generate(): the one-token steps of a static cache replay captured graphs.

generate() asks the model for a compiled forward (`get_compiled_call`) when the cache is compileable (a static
cache) on a GPU; exl3moe's kernels are launched from Python, so instead of torch.compile the model answers
with DecodeGraphs: the first step of each (batch, input layout) runs eagerly and is then captured, and every
later step copies its inputs into the captured buffers and replays. A graph writes the cache it was captured
with, so a new cache (generate() makes one per call) is captured again, replacing the graph of the old one. Nothing in a step syncs with the host:
the static cache advances its own device-side length, and generate() builds the 4-D attention mask outside.
Other calls (prefill, dynamic caches, CPU tensors) run the model eagerly.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

CACHE_KEYS = ("cache", "past_key_values")
MAX_GRAPHS = 8


def _cache_of(kwargs: dict):
    return next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)


def _cache_key(cache) -> tuple:
    """Identity of a cache and of the tensors its layers hold (a reset cache keeps them; a new one does not)."""
    tensors = [getattr(layer, name, None) for layer in getattr(cache, "layers", ()) for name in ("keys", "values")]
    return (id(cache),) + tuple(t.data_ptr() for t in tensors if isinstance(t, torch.Tensor))


def step_tensors(kwargs: dict) -> dict:
    """{(name,) or (name, key): tensor} for every tensor argument, inside dicts too (masks keyed by layer type)."""
    found = {}
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found[(name,)] = value
        elif isinstance(value, dict):
            found.update({(name, key): v for key, v in value.items() if isinstance(v, torch.Tensor)})
    return found


def with_tensors(kwargs: dict, tensors: dict) -> dict:
    """kwargs with the tensors at the paths of `tensors` put in (dicts copied, never changed in place)."""
    out = {name: (dict(v) if isinstance(v, dict) else v) for name, v in kwargs.items()}
    for path, tensor in tensors.items():
        if len(path) == 1:
            out[path[0]] = tensor
        else:
            out[path[0]][path[1]] = tensor
    return out


def capturable(kwargs: dict) -> bool:
    """A one-token step on CUDA with a static (compileable, not dynamic) cache and no embeddings passed."""
    ids = kwargs.get("input_ids")
    cache = _cache_of(kwargs)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 or not ids.is_cuda:
        return False
    if cache is None or not getattr(cache, "is_compileable", False) or type(cache).__name__ == "DynamicCache":
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return all(t.is_cuda for t in step_tensors(kwargs).values())


def step_key(kwargs: dict) -> tuple:
    """(layout of the call, identity of its cache): one graph per layout, captured again for a new cache."""
    tensors = step_tensors(kwargs)
    layout = [(path, tuple(t.shape), t.dtype, t.stride(), str(t.device)) for path, t in sorted(tensors.items())]
    cache = None
    for name in sorted(kwargs):
        value = kwargs[name]
        if name in CACHE_KEYS and value is not None:
            cache = _cache_key(value)
        elif isinstance(value, dict):
            layout.append((name, tuple((k, repr(v)) for k, v in sorted(value.items()) if not isinstance(v, torch.Tensor))))
        elif not isinstance(value, torch.Tensor):
            layout.append((name, repr(value)))
    return tuple(layout), cache


class _Captured:
    """A captured step: its graph, the input buffers it reads (by argument path) and its output."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict, output, cache_key):
        self.graph, self.inputs, self.output, self.cache_key = graph, inputs, output, cache_key

    def replay(self, kwargs: dict):
        for path, tensor in step_tensors(kwargs).items():
            self.inputs[path].copy_(tensor)
        self.graph.replay()
        return type(self.output)(**{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.output.items()})


class DecodeGraphs:
    """Callable like the model; replays captured decode steps (see the module docstring)."""

    def __init__(self, model: nn.Module, max_graphs: int = MAX_GRAPHS):
        self.model = model
        self.max_graphs = max_graphs
        self.graphs: OrderedDict = OrderedDict()
        self.pool = None
        self.replays = self.captures = 0
        self.enabled = True
        self.failed: dict = {}    # layout -> why its capture failed (those steps run eagerly)

    def __call__(self, *args, **kwargs):
        if args or not self.enabled or not capturable(kwargs):
            return self.model(*args, **kwargs)
        layout, cache_key = step_key(kwargs)
        if layout in self.failed:
            return self.model(**kwargs)
        captured = self.graphs.pop(layout, None)
        if captured is not None and captured.cache_key == cache_key:
            self.graphs[layout] = captured
            self.replays += 1
            return captured.replay(kwargs)
        # A graph of an older cache of this layout goes once its successor is captured: it keeps the shared pool
        # in use meanwhile (a pool that no graph uses any more cannot take another capture).
        return self._run_and_capture(layout, cache_key, kwargs, stale=captured)

    def _run_and_capture(self, layout: tuple, cache_key: tuple, kwargs: dict, stale: "_Captured | None" = None):
        """Run this step eagerly (its result is returned), then capture the same step on copies of its inputs;
        `stale` (the graph this one replaces) is released after the capture."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            result = self.model(**kwargs)
        current.wait_stream(side)
        inputs = {path: t.clone() for path, t in step_tensors(kwargs).items()}
        if self.pool is None or (not self.graphs and stale is None):   # no graph holds the old pool: a new one
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.model(**with_tensors(kwargs, inputs))
        except RuntimeError as err:        # a model whose step cannot be captured decodes eagerly
            self.failed[layout] = f"{type(err).__name__}: {err}"
            return result
        del stale
        self.graphs[layout] = _Captured(graph, inputs, output, cache_key)
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return result


def install_decode_graphs(model: nn.Module) -> DecodeGraphs:
    """Make generate() with a static cache on CUDA decode through DecodeGraphs (model.decode_graphs)."""
    runner = DecodeGraphs(model)
    model.decode_graphs = runner
    model.get_compiled_call = lambda compile_config=None: runner
    return runner
