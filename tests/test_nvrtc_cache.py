"""The disk cache of compiled CUDA kernels: one compile per (source, defines, arch, NVRTC version)."""

import os

from exl3moe.kernels import nvrtc


def fake_compiler(monkeypatch):
    compiles = []

    def compile_cubin(text, defines, arch):
        compiles.append((text, dict(defines), arch))
        return f"cubin of {text} {sorted(defines.items())} {arch}".encode()

    monkeypatch.setattr(nvrtc, "compile_cubin", compile_cubin)
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: "13.0")
    return compiles


def test_second_process_reads_the_cubin_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3MOE_CACHE_DIR", str(tmp_path))
    compiles = fake_compiler(monkeypatch)
    first = nvrtc.cached_cubin("source", {"MT": 1, "NT": 2}, "sm_90")
    again = nvrtc.cached_cubin("source", {"NT": 2, "MT": 1}, "sm_90")
    assert first == again and len(compiles) == 1
    assert [p.suffix for p in tmp_path.iterdir()] == [".cubin"]
    for text, defines, arch in (("source2", {"MT": 1, "NT": 2}, "sm_90"), ("source", {"MT": 2, "NT": 2}, "sm_90"),
                                ("source", {"MT": 1, "NT": 2}, "sm_100")):
        assert nvrtc.cached_cubin(text, defines, arch) != first
    assert len(compiles) == 4 and len(list(tmp_path.iterdir())) == 4
    monkeypatch.setattr(nvrtc, "nvrtc_version", lambda: "13.1")
    nvrtc.cached_cubin("source", {"MT": 1, "NT": 2}, "sm_90")
    assert len(compiles) == 5, "a new NVRTC compiles again"


def test_empty_entry_is_recompiled_and_empty_setting_disables_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3MOE_CACHE_DIR", str(tmp_path))
    compiles = fake_compiler(monkeypatch)
    path = nvrtc.cubin_path("source", {"MT": 1}, "sm_90")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()
    assert nvrtc.cached_cubin("source", {"MT": 1}, "sm_90").startswith(b"cubin of source")
    assert len(compiles) == 1 and os.path.getsize(path) > 0
    monkeypatch.setenv("EXL3MOE_CACHE_DIR", "")
    assert nvrtc.cache_dir() is None and nvrtc.cubin_path("source", {"MT": 1}, "sm_90") is None
    nvrtc.cached_cubin("source", {"MT": 1}, "sm_90")
    assert len(compiles) == 2


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("EXL3MOE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_dir() == os.path.join(str(tmp_path), "exl3moe", "cubins")


def test_noted_variants_are_rebuilt_for_the_current_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("EXL3MOE_CACHE_DIR", str(tmp_path))
    compiles = fake_compiler(monkeypatch)
    defines = {"K2": 8, "CB": 1, "DENSE_KTILES": "4"}
    nvrtc.record_variant("trellis_dense.cu", defines, "// prelude\n", "sm_90")
    nvrtc.record_variant("trellis_dense.cu", defines, "// prelude\n", "sm_90")
    assert len(os.listdir(tmp_path / "variants")) == 1
    assert nvrtc.rebuild_variants() == (1, 0)
    text = "// prelude\n" + nvrtc.source("trellis_dense.cu")
    assert compiles == [(text, defines, "sm_90")]
    assert os.path.isfile(nvrtc.cubin_path(text, defines, "sm_90"))
    assert nvrtc.rebuild_variants() == (0, 1), "a cached variant is not compiled again"


def test_source_from_another_directory_expands_its_own_includes(tmp_path):
    from importlib import resources
    cuda = resources.files("exl3moe.kernels").joinpath("cuda")
    for source in cuda.iterdir():
        (tmp_path / source.name).write_text(source.read_text())
    assert nvrtc.source("moe_mma.cu", directory=str(tmp_path)) == nvrtc.source("moe_mma.cu")
    (tmp_path / "trellis_core.cuh").write_text("// another core\n")
    text = nvrtc.source("moe_mma.cu", directory=str(tmp_path))
    assert "// another core" in text and "mma_mainloop(" not in text.split("moe_gate_up_mma")[0]
