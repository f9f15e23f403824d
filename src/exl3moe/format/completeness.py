"""A checkpoint checked against itself: the manifest exllamav3 writes (quantization_config.json's tensor_storage),
the config's codebook, and every linear its architecture defines. Each problem is a FormatError naming a tensor."""

from __future__ import annotations

from ..errors import FormatError
from .architecture import expected
from .codebook import CODEBOOKS
from .safetensors_io import DTYPES
from .weight import MARKERS

QUANT_CONFIG_FILE = "quantization_config.json"
CONFIG_FILE = "config.json"
MANIFEST_DTYPES = {str(dtype): name for name, dtype in DTYPES.items()}   # "torch.float16" -> "F16"
ORPHAN_SUBKEYS = ("suh", "svh", "su", "sv", "mcg", "mul1")   # parts of a quantized linear that need its trellis
NOT_EXL3 = "this is not an EXL3 checkpoint: convert it with exllamav3's converter"


def check_complete(config: dict, entries: dict, linears: dict, storage: dict | None) -> list:
    """Every problem found, first per tensor name: FormatErrors in the order codebook, manifest, orphaned parts,
    architecture. `entries` maps stored names to TensorEntry, `linears` module keys to LinearInfo; `storage` is
    the manifest's tensor_storage or None when the checkpoint has no manifest."""
    problems = codebook_problems(config, linears)
    if storage is not None:
        problems += manifest_problems(storage, entries, linears)
    problems += orphan_problems(entries, linears)
    problems += architecture_problems(config, entries, linears, storage)
    if not linears:
        problems.append(FormatError(CONFIG_FILE, f"says quant_method exl3 but no tensor is EXL3-quantized (no "
                                                 f"<module>.trellis is stored): {NOT_EXL3}"))
    first: dict = {}
    for problem in problems:
        first.setdefault(problem.name, problem)
    return list(first.values())


def codebook_problems(config: dict, linears: dict) -> list:
    """A linear whose marker contradicts config.json's quantization_config.codebook."""
    codebook = config["quantization_config"].get("codebook")
    if codebook is None:
        return []
    where = "config.json's quantization_config.codebook"
    if codebook not in CODEBOOKS:
        return [FormatError(f"{CONFIG_FILE}:quantization_config.codebook",
                            f"must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")]
    problems = []
    for info in linears.values():
        if info.codebook == codebook:
            continue
        if info.codebook == "3inst":
            problems.append(FormatError(f"{info.key}.{codebook}", f"missing: {where} is {codebook} but this linear "
                                        "stores no codebook marker (it would decode as 3inst): the checkpoint "
                                        "contradicts itself"))
        else:
            problems.append(FormatError(f"{info.key}.{info.codebook}", f"marks the {info.codebook} codebook, {where} "
                                        f"is {codebook}: the checkpoint contradicts itself"))
    return problems


def _record_problems(name: str, info, entry) -> list:
    """One stored tensor against its manifest record (shape, dtype, n_bytes)."""
    if not isinstance(info, dict):
        return [FormatError(name, f"{QUANT_CONFIG_FILE} records it as {type(info).__name__}, not an object")]
    said = f"{info.get('dtype')} {info.get('shape')}"
    stored = f"{entry.dtype} {list(entry.shape)} in {entry.shard}"
    if "dtype" in info and MANIFEST_DTYPES.get(info["dtype"]) != entry.dtype:
        return [FormatError(name, f"is {stored}, {QUANT_CONFIG_FILE} says {said}")]
    if "shape" in info and info["shape"] != list(entry.shape):
        return [FormatError(name, f"is {stored}, {QUANT_CONFIG_FILE} says {said}")]
    if "n_bytes" in info and info["n_bytes"] != entry.nbytes:
        return [FormatError(name, f"holds {entry.nbytes} bytes in {entry.shard}, {QUANT_CONFIG_FILE} says "
                                  f"{info['n_bytes']!r}")]
    return []


def _quantized_record_problems(module: str, record: dict, linears: dict) -> list:
    """A module the manifest records as EXL3: stored as a linear of that K and codebook marker."""
    fmt = record.get("quant_format")
    if fmt is None:
        return []
    if fmt != "exl3":
        return [FormatError(f"{QUANT_CONFIG_FILE}:{module}", f"quant_format must be 'exl3', got {fmt!r}")]
    info = linears.get(module)
    if info is None:
        return [FormatError(f"{module}.trellis", f"missing: {QUANT_CONFIG_FILE} records {module} as EXL3-quantized")]
    bits = record.get("bits_per_weight")
    if bits is not None and bits != info.K:
        return [FormatError(f"{module}.trellis", f"holds K={info.K:g}, {QUANT_CONFIG_FILE} says bits_per_weight "
                                                 f"{bits!r}")]
    for codebook, value in MARKERS.items():
        said = record.get(f"{codebook}_multiplier")
        if said is not None and info.codebook != codebook:
            return [FormatError(f"{module}.{codebook}", f"missing: {QUANT_CONFIG_FILE} records a {codebook} marker "
                                f"for {module}, the stored linear is {info.codebook}")]
        if said is not None and said != value:
            return [FormatError(f"{module}.{codebook}", f"{QUANT_CONFIG_FILE} records {codebook}_multiplier "
                                f"{said!r}, the codebook's is {value}")]
        if said is None and info.codebook == codebook:
            return [FormatError(f"{module}.{codebook}", f"stored, but {QUANT_CONFIG_FILE} records no "
                                f"{codebook}_multiplier for {module}")]
    return []


def manifest_problems(storage, entries: dict, linears: dict) -> list:
    """Names, shapes, dtypes and markers of the manifest against the stored tensors, both ways."""
    if not isinstance(storage, dict):
        return [FormatError(f"{QUANT_CONFIG_FILE}:tensor_storage", "must map module names to records")]
    problems, listed = [], set()
    for module, record in storage.items():
        stored = record.get("stored_tensors") if isinstance(record, dict) else None
        if not isinstance(stored, dict):
            problems.append(FormatError(f"{QUANT_CONFIG_FILE}:{module}", "record must hold a stored_tensors object"))
            continue
        for name, info in stored.items():
            listed.add(name)
            entry = entries.get(name)
            if entry is None:
                problems.append(FormatError(name, f"missing: {QUANT_CONFIG_FILE} lists it under {module}, no shard "
                                                  "stores it"))
            else:
                problems += _record_problems(name, info, entry)
        problems += _quantized_record_problems(module, record, linears)
    problems += [FormatError(name, f"stored in {entry.shard} but not listed in {QUANT_CONFIG_FILE}'s tensor_storage")
                 for name, entry in entries.items() if name not in listed]
    return problems


def orphan_problems(entries: dict, linears: dict) -> list:
    """Scales or markers of a linear whose trellis is not stored."""
    orphans: dict = {}
    for name in entries:
        module, _, sub = name.rpartition(".")
        if sub in ORPHAN_SUBKEYS and module not in linears and f"{module}.trellis" not in entries:
            orphans.setdefault(module, []).append(sub)
    return [FormatError(f"{module}.trellis", f"missing: {module}'s {', '.join(subs)} are stored without it")
            for module, subs in orphans.items()]


def _recorded_plain(storage: dict | None, key: str) -> bool:
    record = storage.get(key) if isinstance(storage, dict) else None
    stored = record.get("stored_tensors") if isinstance(record, dict) else None
    return isinstance(stored, dict) and f"{key}.weight" in stored and record.get("quant_format") is None


def architecture_problems(config: dict, entries: dict, linears: dict, storage: dict | None) -> list:
    """Every linear the config's architecture defines: quantized, or plain where the manifest records it so; and
    its routers' tensors."""
    try:
        want = expected(config)
    except FormatError as err:
        return [err]
    if want is None:
        return []
    problems = []
    for key in want.linears:
        if key in linears:
            continue
        plain = entries.get(f"{key}.weight")
        if plain is not None and _recorded_plain(storage, key):
            continue
        if plain is not None:
            problems.append(FormatError(plain.key, f"stored unquantized ({plain.dtype} {list(plain.shape)}) and "
                                        f"{QUANT_CONFIG_FILE} does not record it so: {want.model_type} defines "
                                        f"{key} as a linear, which an EXL3 checkpoint stores as a trellis"))
        else:
            problems.append(FormatError(f"{key}.trellis", f"missing: {want.model_type} defines the linear {key} "
                                                          "(config.json) and the checkpoint does not store it"))
    problems += [FormatError(name, f"missing: {want.model_type} defines this router tensor (config.json)")
                 for name in want.tensors if name not in entries]
    return problems
