"""EXL3 checkpoints (config.json + safetensors shards): validated at open from headers, tensors loaded lazily.

Missing names a caller asks for raise KeyError; anything that breaks the format raises FormatError. Opening checks
the checkpoint against itself (format/completeness.py): its manifest, its config's codebook, its architecture's
linears; `strict=False` keeps what those checks found in `reader.problems` instead of raising the first.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass

from ..errors import ContractError, FormatError
from .bitstream import k_from_last_dim
from .completeness import CONFIG_FILE, NOT_EXL3, QUANT_CONFIG_FILE, check_complete
from .experts import ExpertSet
from .hadamard import HAD
from .safetensors_io import (TensorEntry, read_bytes, read_header, read_tensor, read_tensor_slice, tensor_nbytes,
                             write_shard)
from .shards import shard_range
from .weight import MARKERS, EXL3Weight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_SHARD = "model.safetensors"
DEFAULT_SHARD_BYTES = 8 << 30
LINEAR_SUBKEYS = ("trellis", "suh", "su", "svh", "sv", "mcg", "mul1", "bias")
PROJECTIONS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts")
_PROJ = "|".join(PROJECTIONS)
EXPERT_RE = re.compile(rf"^(?P<prefix>.+)\.experts\.(?P<index>\d+)\.(?P<proj>{_PROJ})$")


def natural_key(key: str) -> list:
    """Sort key that orders layers.2 before layers.10 (ASCII digit runs compare by length, then by text)."""
    return [(len(part.lstrip("0")), part.lstrip("0"), part) if i % 2 else part
            for i, part in enumerate(re.split(r"([0-9]+)", key))]


@dataclass(frozen=True)
class LinearInfo:
    """A quantized linear described from headers alone."""

    key: str
    in_features: int
    out_features: int
    K: float
    codebook: str
    trellis_bytes: int
    stored_bytes: int

    @property
    def numel(self) -> int:
        return self.in_features * self.out_features

    @property
    def bits_per_weight(self) -> float:
        """All stored bits (trellis, scales, marker, bias) per weight."""
        return self.stored_bytes * 8 / self.numel


PASS_DIRECTORY = "pass the checkpoint directory (the folder holding config.json and the *.safetensors shards)"
TRUNCATION_SIGNS = ("truncated", "runs past the end", "lie outside the", "file ended")


def _load_json(path: str, name: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise FormatError(name, f"missing from {os.path.dirname(path)}: {PASS_DIRECTORY}") from None
    except (OSError, ValueError, RecursionError) as err:
        raise FormatError(name, f"cannot be read as JSON: {err}") from None


def _read_config(path: str) -> dict:
    config = _load_json(os.path.join(path, CONFIG_FILE), CONFIG_FILE)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "exl3":
        raise FormatError(CONFIG_FILE, f"quantization_config.quant_method must be 'exl3', got {method!r}: {NOT_EXL3}")
    return config


def _read_manifest(path: str) -> dict | None:
    """quantization_config.json's tensor_storage, or None when the checkpoint has none (no file, or no such key)."""
    file = os.path.join(path, QUANT_CONFIG_FILE)
    if not os.path.exists(file):
        return None
    manifest = _load_json(file, QUANT_CONFIG_FILE)
    return manifest.get("tensor_storage") if isinstance(manifest, dict) else manifest


def _shard_header(path: str) -> dict:
    """read_header, with a hint where the file ends before its header says it should."""
    try:
        return read_header(path)
    except FormatError as err:
        if any(sign in err.rule for sign in TRUNCATION_SIGNS):
            raise FormatError(err.name, f"{err.rule}: the file is truncated (or its header damaged); copy or "
                                        "download it again") from None
        raise


def _check_directory(path: str) -> None:
    if not os.path.exists(path):
        raise FormatError(path, f"no such file or directory: {PASS_DIRECTORY}")
    if not os.path.isdir(path):
        raise FormatError(path, f"is a file, not a checkpoint directory: {PASS_DIRECTORY}")


def _read_index(path: str) -> dict | None:
    """weight_map of model.safetensors.index.json, or None when there is no index."""
    file = os.path.join(path, INDEX_FILE)
    if not os.path.exists(file):
        return None
    index = _load_json(file, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise FormatError(INDEX_FILE, "weight_map must map tensor names to shard file names")
    for shard in set(weight_map.values()):
        if os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
            raise FormatError(INDEX_FILE, f"shard {shard!r} is not a .safetensors file name in the directory")
        if not os.path.isfile(os.path.join(path, shard)):
            raise FormatError(shard, f"named in {INDEX_FILE} but missing from the directory")
    return weight_map


def _expect(entry: TensorEntry | None, name: str, dtypes: tuple, shape: tuple | None = None) -> TensorEntry:
    if entry is None:
        raise FormatError(name, "missing")
    if entry.dtype not in dtypes:
        raise FormatError(name, f"in {entry.shard}: must be {' or '.join(dtypes)}, got {entry.dtype}")
    if shape is not None and entry.shape != shape:
        raise FormatError(name, f"in {entry.shard}: must have shape {list(shape)}, got {list(entry.shape)}")
    return entry


def _linear_info(key: str, entries: dict) -> LinearInfo:
    """Check a linear's stored subkeys from their headers: dtypes, shapes, K, codebook marker."""
    sub = {s: entries.get(f"{key}.{s}") for s in LINEAR_SUBKEYS}
    trellis = _expect(sub["trellis"], f"{key}.trellis", ("I16",))
    if len(trellis.shape) != 3 or 0 in trellis.shape[:2]:
        raise FormatError(trellis.key, f"must be a non-empty 3-D [k/16, n/16, 16K], got {list(trellis.shape)}")
    K = k_from_last_dim(trellis.shape[2], trellis.key)
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    if k % HAD or n % HAD:
        raise FormatError(trellis.key, f"in/out features {k}x{n} must be multiples of {HAD}")
    markers = [cb for cb in MARKERS if sub[cb] is not None]
    if len(markers) > 1:
        raise FormatError(key, "both mcg and mul1 markers are present; a tensor has one codebook")
    codebook = markers[0] if markers else "3inst"
    if markers and (sub[codebook].dtype != "I32" or sub[codebook].numel != 1):
        raise FormatError(f"{key}.{codebook}", "codebook marker must be an int32 scalar")
    if K != int(K) and codebook != "mul1":
        raise FormatError(trellis.key, f"half-integer K={K} needs the mul1 codebook, got {codebook}")
    for scaled, legacy, width in (("suh", "su", k), ("svh", "sv", n)):
        if sub[scaled] is not None:
            _expect(sub[scaled], f"{key}.{scaled}", ("F16",), (width,))
        elif sub[legacy] is not None:
            _expect(sub[legacy], f"{key}.{legacy}", ("I16",), (width // 16,))
        else:
            raise FormatError(f"{key}.{scaled}", f"missing (neither {scaled} nor legacy {legacy} is stored)")
    if sub["bias"] is not None:
        _expect(sub["bias"], f"{key}.bias", ("F16", "F32"), (n,))
    stored = sum(e.nbytes for e in sub.values() if e is not None)
    return LinearInfo(key, k, n, K, codebook, trellis.nbytes, stored)


class CheckpointReader:
    """An opened EXL3 checkpoint directory: config, validated headers, lazily loaded tensors."""

    def __init__(self, path: str, strict: bool = True):
        _check_directory(path)
        self.path = str(path)
        self.config = _read_config(self.path)
        weight_map = _read_index(self.path)
        if weight_map is not None:
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not shards:
            raise FormatError(self.path, "holds no *.safetensors shard")
        self._entries: dict = {}
        for shard in shards:
            for key, entry in _shard_header(os.path.join(self.path, shard)).items():
                if key in self._entries:
                    raise FormatError(key, f"stored twice, in {self._entries[key].shard} and {shard}")
                self._entries[key] = entry
        for key, shard in (weight_map or {}).items():
            if key not in self._entries or self._entries[key].shard != shard:
                raise FormatError(key, f"named in {INDEX_FILE} but missing from its shard {shard}")
        self._linears = {key: _linear_info(key, self._entries) for key in self._linear_keys()}
        self._check_marker_values()
        self.problems = check_complete(self.config, self._entries, self._linears, _read_manifest(self.path))
        if strict and self.problems:
            first, more = self.problems[0], len(self.problems) - 1
            extra = f" (and {more} more problem{'s' if more > 1 else ''}: exl3moe inspect lists them)" if more else ""
            raise FormatError(first.name, first.rule + extra)

    def _linear_keys(self) -> list:
        """Module keys with a trellis, except quantized embeddings (trellis + signs, another ring format)."""
        keys = [k[: -len(".trellis")] for k in self._entries if k.endswith(".trellis")]
        return sorted((k for k in keys if f"{k}.signs" not in self._entries), key=natural_key)

    def _check_marker_values(self) -> None:
        """Every marker must hold its codebook's multiplier (4 bytes read per marker, one open per shard)."""
        by_shard: dict = {}
        for info in self._linears.values():
            if info.codebook in MARKERS:
                entry = self._entries[f"{info.key}.{info.codebook}"]
                by_shard.setdefault(entry.path, []).append((entry, MARKERS[info.codebook]))
        for path, markers in by_shard.items():
            try:
                handle = open(path, "rb")
            except OSError as err:
                raise FormatError(os.path.basename(path), f"cannot read shard: {err}") from None
            with handle:
                for entry, want in markers:
                    (value,) = struct.unpack("<I", read_bytes(entry, handle))
                    if value != want:
                        raise FormatError(entry.key, f"codebook marker must hold 0x{want:08X}, got 0x{value:08X}")

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list:
        return sorted(self._entries, key=natural_key)

    def entry(self, key: str) -> TensorEntry:
        """Header record of one tensor (shard, dtype, shape, bytes); KeyError if absent."""
        if key not in self._entries:
            raise KeyError(f"{key}: no such tensor in {self.path}")
        return self._entries[key]

    @property
    def tensor_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def tensor(self, key: str, device=None):
        """One stored tensor as a plain torch.Tensor, read now (CPU unless device is given)."""
        return read_tensor(self.entry(key), device)

    def linears(self) -> list:
        """LinearInfo for every quantized linear, from headers only."""
        return list(self._linears.values())

    def linear(self, key: str, device=None, columns: tuple | None = None, rows: tuple | None = None) -> EXL3Weight:
        """Load `<key>.trellis`, scales, marker and bias as a validated EXL3Weight; with columns=(start, stop) or
        rows=(start, stop) (whole 128-wide blocks), only those output columns or input rows are read."""
        if key not in self._linears:
            raise KeyError(f"{key}: not a quantized linear in {self.path}")
        if columns is None and rows is None:
            parts = {s: self.tensor(f"{key}.{s}", device) for s in LINEAR_SUBKEYS if f"{key}.{s}" in self._entries}
            return EXL3Weight.from_tensors(parts, name=key)
        if columns is not None and rows is not None:
            raise ContractError(key, "a slice takes columns or rows, not both")
        info = self._linears[key]
        by_rows = rows is not None
        start, stop = _block_slice(rows if by_rows else columns, info.in_features if by_rows else info.out_features,
                                   f"{key} ({'rows' if by_rows else 'columns'})")
        sliced = {"trellis": (1 - by_rows, 16), "suh": (0, 1) if by_rows else None, "su": (0, 16) if by_rows else None,
                  "svh": None if by_rows else (0, 1), "sv": None if by_rows else (0, 16),
                  "bias": None if by_rows else (0, 1)}
        parts = {}
        for sub in LINEAR_SUBKEYS:
            name = f"{key}.{sub}"
            if name not in self._entries or (sub == "bias" and by_rows and start > 0):
                continue
            cut = sliced.get(sub)
            parts[sub] = (self.tensor(name, device) if cut is None else
                          read_tensor_slice(self._entries[name], cut[0], start // cut[1], stop // cut[1], device))
        what = "rows" if by_rows else "columns"
        return EXL3Weight.from_tensors(parts, name=f"{key}[{what} {start}:{stop}]")

    def moe_layers(self) -> list:
        """Prefixes (e.g. model.layers.0.mlp) that hold routed experts."""
        prefixes = {m["prefix"] for m in map(EXPERT_RE.match, self._linears) if m}
        return sorted(prefixes, key=natural_key)

    def _projection_keys(self, group_re: re.Pattern, where: str) -> dict:
        """{member: {role: module key}} for every module whose name matches group_re; all must be quantized."""
        found: dict = {}
        names = set()
        for key in self._entries:
            module = key.rsplit(".", 1)[0]
            m = group_re.match(module)
            if not m:
                continue
            if module not in self._linears:
                raise FormatError(module, "is not EXL3-quantized (no trellis with scales); experts must be")
            names.add(m["proj"].startswith("w"))
            found.setdefault(m["member"], {})[PROJECTIONS[m["proj"]]] = module
        if len(names) > 1:
            raise FormatError(where, "mixes gate_proj/up_proj/down_proj and w1/w3/w2 names")
        return found

    def _build_set(self, members: list, found: dict, where: str, activation: str, limit, device,
                   tensor_shard: tuple | None = None) -> ExpertSet:
        roles = found[members[0]]
        for member in members:
            if set(found[member]) != set(roles):
                raise FormatError(f"{where}.{member}", f"has projections {sorted(found[member])}, "
                                  f"{where}.{members[0]} has {sorted(roles)}")
        for role in ("up", "down"):
            if role not in roles:
                raise FormatError(where, f"no {role} projection")
        cut = {}
        if tensor_shard is not None:
            blocks = self._linears[found[members[0]]["down"]].in_features // HAD
            first, stop = _shard_range(blocks, tensor_shard, f"{where} intermediate", f"blocks of {HAD}")
            span = (first * HAD, stop * HAD)
            cut = {"gate": {"columns": span}, "up": {"columns": span}, "down": {"rows": span}}
            where = f"{where}[tensor {tensor_shard[0]}/{tensor_shard[1]}]"
        load = lambda role: [self.linear(found[m][role], device, **cut.get(role, {})) for m in members]  # noqa: E731
        gate = load("gate") if "gate" in roles else None
        return ExpertSet(gate, load("up"), load("down"), activation, limit, name=where)

    def experts(self, prefix: str, activation: str = "silu", limit: float | None = None, device=None,
                shard: tuple | None = None, tensor_shard: tuple | None = None) -> ExpertSet:
        """Routed experts `<prefix>.experts.<i>.<proj>` (gate_proj/up_proj/down_proj or w1/w3/w2); with
        shard=(rank, world), only that rank's contiguous experts (format/shards.py) are read; with
        tensor_shard=(rank, world), only that rank's slice of every expert's intermediate width (gate / up columns,
        down rows, whole 128-wide blocks: parallel/experts.py's tensor_shard)."""
        where = f"{prefix}.experts"
        group_re = re.compile(rf"^{re.escape(where)}\.(?P<member>\d+)\.(?P<proj>{_PROJ})$")
        found = self._projection_keys(group_re, where)
        if not found:
            raise KeyError(f"{prefix}: no routed experts in {self.path}")
        for member in found:
            if not re.fullmatch(r"0|[1-9][0-9]*", member):
                raise FormatError(f"{where}.{member}", "expert index is not a plain decimal number 0, 1, 2, ...")
        for index in range(len(found)):
            if str(index) not in found:
                raise FormatError(f"{where}.{index}", f"missing: {len(found)} experts are numbered 0..{len(found) - 1}")
        first, stop = (0, len(found)) if shard is None else _shard_range(len(found), shard)
        return self._build_set([str(i) for i in range(first, stop)], found, where, activation, limit, device,
                               tensor_shard)

    def shared_expert(self, prefix: str, activation: str = "silu", limit: float | None = None,
                      device=None, tensor_shard: tuple | None = None) -> ExpertSet | None:
        """The shared expert `<prefix>.shared_expert(s).<proj>` as a one-expert ExpertSet, or None; tensor_shard
        as for experts()."""
        names = "|".join(SHARED_EXPERT_NAMES)
        group_re = re.compile(rf"^{re.escape(prefix)}\.(?P<member>{names})\.(?P<proj>{_PROJ})$")
        found = self._projection_keys(group_re, prefix)
        if len(found) > 1:
            raise FormatError(prefix, f"holds both {' and '.join(sorted(found))}; expected one shared expert")
        if not found:
            return None
        (member,) = found
        return self._build_set([member], found, f"{prefix}.{member}", activation, limit, device, tensor_shard)


def _block_slice(span, features: int, name: str) -> tuple:
    """(start, stop) of a slice of whole 128-wide blocks within `features`, checked."""
    if (not isinstance(span, tuple) or len(span) != 2 or not all(type(v) is int for v in span)
            or not 0 <= span[0] < span[1] <= features or span[0] % HAD or span[1] % HAD):
        raise ContractError(name, f"slice must be (start, stop) of whole {HAD}-wide blocks within {features}, "
                            f"got {span!r}")
    return span


def _shard_range(count: int, shard, name: str = "experts", unit: str = "experts") -> tuple:
    """(first, stop) of rank `shard[0]` of `shard[1]` over `count` units, checked."""
    if not isinstance(shard, tuple) or len(shard) != 2:
        raise ContractError("shard", f"must be a (rank, world) tuple, got {shard!r}")
    return shard_range(count, *shard, name, unit)


def open_checkpoint(path, strict: bool = True) -> CheckpointReader:
    """Open an EXL3 checkpoint directory; reads config, manifest, index and shard headers (and 4 bytes per codebook
    marker) only. The checkpoint must agree with itself (format/completeness.py): a missing, extra or contradictory
    tensor is a FormatError naming it, unless strict=False, which lists them in `reader.problems` instead."""
    return CheckpointReader(os.fspath(path), strict)


def _module_key(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else key


def _groups(linears: dict, tensors: dict) -> list:
    """[(module key, {full key: tensor})]: one group per linear, one per plain tensor, keys unique."""
    groups, seen = [], set()
    for key, weight in linears.items():
        if not isinstance(weight, EXL3Weight):
            raise ContractError(key, f"linears must map keys to EXL3Weight, got {type(weight).__name__}")
        groups.append((key, {f"{key}.{s}": t for s, t in weight.stored_tensors().items()}))
    groups += [(_module_key(key), {key: t}) for key, t in tensors.items()]
    for _, group in groups:
        for key in group:
            if key in seen:
                raise ContractError(key, "given twice (as a linear's subkey and as a tensor, or twice)")
            seen.add(key)
    return groups


def _plan_shards(groups: list, max_shard_bytes: int) -> list:
    """Greedy packing in order; a group is never split and a shard closes when the next group would overflow it."""
    shards, size = [{}], 0
    for _, group in groups:
        group_size = sum(tensor_nbytes(t) for t in group.values())
        if size and size + group_size > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(group)
        size += group_size
    return shards


def _quantization_config(config: dict, linears: dict) -> dict:
    """config.json's quantization_config: kept if already exl3, with bits/head_bits/codebook from the linears."""
    old = config.get("quantization_config")
    if isinstance(old, dict) and old.get("quant_method") == "exl3":
        qc = {k: v for k, v in old.items() if k != "tensor_storage"}
    else:
        qc = {"original_quantization_config": old} if isinstance(old, dict) else {}
    qc["quant_method"] = "exl3"
    body = [w for key, w in linears.items() if key != "lm_head"]
    if body:
        weights = sum(w.in_features * w.out_features for w in body)
        qc["bits"] = round(sum(w.K * w.in_features * w.out_features for w in body) / weights, 2)
    if "lm_head" in linears:
        qc["head_bits"] = linears["lm_head"].K
    codebooks = {w.codebook for w in linears.values()}
    if len(codebooks) == 1:
        qc["codebook"] = codebooks.pop()
    elif codebooks:
        qc.pop("codebook", None)   # one codebook no longer describes every linear
    return qc


def _tensor_storage(groups: list, linears: dict) -> dict:
    """quantization_config.json's tensor_storage, as exllamav3 writes it."""
    storage: dict = {}
    for module, group in groups:
        record = storage.setdefault(module, {"stored_tensors": {}})
        for key, t in group.items():
            record["stored_tensors"][key] = {"shape": list(t.shape), "n_bytes": tensor_nbytes(t), "dtype": str(t.dtype)}
        if module in linears:
            w = linears[module]
            record.update(quant_format="exl3", bits_per_weight=int(w.K) if w.K == int(w.K) else w.K)
            if w.codebook in MARKERS:
                record[f"{w.codebook}_multiplier"] = MARKERS[w.codebook]
    return storage


def _write_json(path: str, doc: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, indent=4))


def write_checkpoint(path, linears: dict, tensors: dict, config: dict,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list:
    """Write an EXL3 checkpoint as exllamav3 lays it out; returns the shard file names written."""
    path = os.fspath(path)
    if not isinstance(config, dict):
        raise ContractError("config", f"must be a dict, got {type(config).__name__}")
    if max_shard_bytes <= 0:
        raise ContractError("max_shard_bytes", f"must be positive, got {max_shard_bytes}")
    groups = _groups(linears, tensors)
    os.makedirs(path, exist_ok=True)
    stale = [f for f in os.listdir(path) if f.endswith(".safetensors") or f == INDEX_FILE]
    if stale:
        raise ContractError(path, f"already holds {stale[0]}; write into an empty directory")
    shards = _plan_shards(groups, max_shard_bytes)
    count = len(shards)
    names = [SINGLE_SHARD] if count == 1 else [f"model-{i + 1:05}-of-{count:05}.safetensors" for i in range(count)]
    weight_map = {}
    for name, shard in zip(names, shards):
        write_shard(os.path.join(path, name), shard)
        weight_map.update(dict.fromkeys(shard, name))
    if count > 1:
        total = sum(tensor_nbytes(t) for shard in shards for t in shard.values())
        _write_json(os.path.join(path, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    qc = _quantization_config(config, linears)
    config = {**config, "quantization_config": qc}
    if "lm_head" in linears and "tie_word_embeddings" in config:
        config["tie_word_embeddings"] = False  # a stored lm_head is untied, as exllamav3 records it
    _write_json(os.path.join(path, CONFIG_FILE), config)
    _write_json(os.path.join(path, QUANT_CONFIG_FILE), {**qc, "tensor_storage": _tensor_storage(groups, linears)})
    return names
