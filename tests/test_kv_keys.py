"""KV connector keys name the weights' content and the KV layout (issue 36, item 4).

Two different `model.gguf` files used to share one store prefix (the file's name), and the
tensor-parallel layout was not in it; a connector with tensor_parallel_size > 1 failed later with
an unrelated AttributeError. No Mooncake is needed here: the prefix is computed from the config.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.kv_transfer import keys
from engine.kv_transfer.mooncake_store import default_key_prefix

ROOT = Path(__file__).resolve().parents[1]


def write_gguf(path: Path, seed: int) -> Path:
    """A one-layer Llama GGUF (hidden 16, 2 heads, vocab 32) with float32 weights from `seed`."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    h, ffn, vocab = 16, 24, 32
    w = gguf.GGUFWriter(str(path), "llama")
    for key, val in [("block_count", 1), ("embedding_length", h), ("feed_forward_length", ffn),
                     ("attention.head_count", 2), ("attention.head_count_kv", 2), ("context_length", 64)]:
        w.add_uint32(f"llama.{key}", val)
    shapes = {"token_embd": (vocab, h), "output_norm": (h,), "blk.0.attn_norm": (h,), "blk.0.ffn_norm": (h,),
              "blk.0.attn_q": (h, h), "blk.0.attn_k": (h, h), "blk.0.attn_v": (h, h), "blk.0.attn_output": (h, h),
              "blk.0.ffn_gate": (ffn, h), "blk.0.ffn_up": (ffn, h), "blk.0.ffn_down": (h, ffn)}  # fmt: skip
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def config(model: str, **kwargs: object) -> EngineConfig:
    return EngineConfig.from_kwargs(model, dtype="float32", **kwargs)


def test_two_files_of_one_name_get_different_prefixes(tmp_path: Path) -> None:
    a = write_gguf(tmp_path / "a" / "model.gguf", seed=1)
    b = write_gguf(tmp_path / "b" / "model.gguf", seed=2)
    assert a.stat().st_size == b.stat().st_size  # same name, same size: only the content differs
    pa, pb = default_key_prefix(config(str(a))), default_key_prefix(config(str(b)))
    assert pa != pb and pa.startswith("servelab/model.gguf@") and pb.startswith("servelab/model.gguf@")
    # A copy elsewhere, with another mtime, is the same weights: the same prefix.
    c = tmp_path / "c" / "model.gguf"
    c.parent.mkdir()
    c.write_bytes(a.read_bytes())
    assert default_key_prefix(config(str(c))) == pa


def test_the_same_file_gives_the_same_prefix_in_another_process(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf", seed=3)
    here = default_key_prefix(config(str(path), block_size=8))
    code = ("import sys; from engine.config import EngineConfig; from engine.kv_transfer.keys import default_key_prefix; "
            "print(default_key_prefix(EngineConfig.from_kwargs(sys.argv[1], dtype='float32', block_size=8)))")
    there = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip().splitlines()[-1]  # fmt: skip
    assert there == here


def test_the_layout_is_in_the_prefix() -> None:
    one = default_key_prefix(config("llama-3-8b"))
    two = [default_key_prefix(config("llama-3-8b", tensor_parallel_size=2), rank=r) for r in (0, 1)]
    assert len({one, *two}) == 3  # TP size, and each rank's head slice
    assert "-tp1r0-kvh0+8-" in one and "-tp2r1-kvh4+4-" in two[1]
    assert default_key_prefix(config("llama-3-8b", block_size=32)) != one
    assert default_key_prefix(config("llama-3-8b", seed=1)) != one  # dummy weights: their seed
    assert default_key_prefix(config("llama-3-8b", num_layers_override=2)) != one
    bf16 = EngineConfig.from_kwargs("llama-3-8b", dtype="bfloat16")
    assert default_key_prefix(bf16) != one


def test_a_big_file_is_not_read_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = tmp_path / "big.gguf"
    with open(big, "wb") as f:  # 1 GiB, sparse: costs no disk
        f.truncate(1 << 30)
    read = []
    real_open = open

    class Counting:
        def __init__(self, *args: object) -> None:
            self.f = real_open(*args)  # type: ignore[call-overload]

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def seek(self, at: int) -> None:
            self.f.seek(at)

        def read(self, n: int) -> bytes:
            data = self.f.read(n)
            read.append(len(data))
            return data

    monkeypatch.setattr(keys, "open", Counting, raising=False)
    first = keys.file_digest(big)
    assert sum(read) <= keys.HEAD_BYTES + keys.NUM_SAMPLES * keys.SAMPLE_BYTES
    assert keys.file_digest(big) == first and len(read) == 1 + keys.NUM_SAMPLES  # the second one is cached
    with open(big, "r+b") as f:  # a change in the last slice changes the digest
        f.seek((1 << 30) - 10)
        f.write(b"x")
    assert keys.file_digest(big) != first


def test_tensor_parallel_with_a_connector_is_refused_at_start_up() -> None:
    kv = {"kv_connector": "CPUOffloadConnector"}
    with pytest.raises(ValueError) as err:
        EngineConfig.from_kwargs("smollm2", tensor_parallel_size=2, kv_transfer_config=kv)
    text = str(err.value)
    assert "kv_transfer.kv_connector=CPUOffloadConnector" in text and "tensor_parallel_size=2" in text
    assert "\n" not in text
    from engine.frontend.llm import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported"):  # before any rank starts
        LLM(model="smollm2", tensor_parallel_size=2, kv_transfer_config=kv)
