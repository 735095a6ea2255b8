"""A text GGUF plus llama.cpp's mmproj GGUF served in place as one SmolVLM / Idefics3 model
(`--mmproj`), both files made by llama.cpp's own converter from the tiny random Idefics3
checkpoint (tests/support/gguf_vision.py): the cached conversion's processor loads in a
torch-free process and equals the checkpoint's; F32 files give the safetensors checkpoint's
greedy tokens exactly; a Q8_0 text GGUF (llama-quantize) stays packed and matches
transformers on its dequantized weights within near-ties; an F16 mmproj fills the vision
tower with the checkpoint's weights in float16; `pagedserve serve --model --mmproj` answers
an image; and the files or flag combinations we cannot serve are one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engine.frontend.llm import LLM
from engine.model_loader import ModelSourceError, load_model, resolve_model
from engine.multimodal.inputs import image_content_hash
from engine.multimodal.processor import ImagePromptProcessor
from engine.sampling_params import SamplingParams
from tests.support import gguf_vision
from tests.support.hf_reference import assert_greedy_matches
from tests.support.vlm_fixtures import sample_images

pytestmark = pytest.mark.skipif(gguf_vision.missing_tools() is not None,
                                reason=gguf_vision.missing_tools() or "")

NUM_NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
NEAR_TIE_LOGPROB_GAP = 0.2


def chat_prompt(question: str, num_images: int) -> str:
    """The SmolVLM template, rendered (as tests/engine/test_vision_engine.py writes it)."""
    return f"<|im_start|>User:{'<image>' * num_images}{question}<end_of_utterance>\nAssistant:"


def image_prompts() -> list[dict]:
    a, b, c = sample_images()
    return [
        {"prompt": chat_prompt("What is this?", 1), "multi_modal_data": {"image": a}},
        {"prompt": chat_prompt("Compare them.", 2), "multi_modal_data": {"image": [b, c]}},
        {"prompt": chat_prompt("And this one?", 1), "multi_modal_data": {"image": c}},
    ]


def generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


class _Image:
    def __init__(self, image):
        self.image, self.content_hash = image, image_content_hash(image)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The checkpoint and what llama.cpp's tools make of it; conversions cached in a
    directory of this module's own."""
    root = tmp_path_factory.mktemp("gguf-vision")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PAGEDSERVE_CACHE", str(root / "cache"))
        checkpoint = gguf_vision.build_smolvlm_checkpoint(root / "hf")
        made = {
            "checkpoint": checkpoint, "cache": root / "cache",
            "text": gguf_vision.convert_text(checkpoint, root / "smolvlm-text-F32.gguf"),
            "mmproj": gguf_vision.convert_mmproj(checkpoint, root / "mmproj-F32.gguf"),
            "stub": gguf_vision.write_projector_stub(root / "mmproj-gemma3.gguf", "gemma3"),
        }
        yield made


@pytest.fixture(scope="module")
def f32_pair(files):
    return resolve_model(files["text"], mmproj=files["mmproj"])


@pytest.fixture(scope="module")
def checkpoint_tokens(files) -> list[list[int]]:
    """Our greedy tokens for image_prompts() on the safetensors checkpoint (which
    tests/engine/test_vision_engine.py holds equal to transformers')."""
    with LLM(str(files["checkpoint"]), dtype="float32", max_model_len=512) as llm:
        return generate(llm, image_prompts())


def test_conversion_is_a_vision_config_and_processor_the_frontend_loads_without_torch(
        files, tmp_path):
    # Convert in a process that never imports torch, and read the processor there with
    # torch made unimportable, as the HTTP frontend does.
    images = sample_images()
    for index in (0, 2):
        images[index].save(tmp_path / f"image{index}.png")
    script = tmp_path / "frontend.py"
    script.write_text(textwrap.dedent("""
        import json, sys
        import numpy as np
        from engine.model_loader import resolve_model

        if __name__ == "__main__":
            text, mmproj, cache, folder = sys.argv[1:]
            resolved = resolve_model(text, cache_dir=cache, mmproj=mmproj)
            assert "torch" not in sys.modules, "the conversion imported torch here"
            from server.http.torch_free import keep_torch_out
            assert keep_torch_out()
            from PIL import Image
            from engine.multimodal.inputs import image_content_hash
            from engine.multimodal.processor import ImagePromptProcessor

            class Loaded:
                def __init__(self, path):
                    self.image = Image.open(path).convert("RGB")
                    self.content_hash = image_content_hash(self.image)

            processor = ImagePromptProcessor.for_model(resolved.path)
            images = [Loaded(f"{folder}/image{i}.png") for i in (0, 2)]
            done = processor.process("User:<image><image>Hi", images)
            np.savez(f"{folder}/pixels.npz",
                     *[f.tensors["pixel_values"].to_array() for f in done.features])
            print(json.dumps({"dir": str(resolved.path), "name": resolved.served_model_name,
                              "token_ids": done.token_ids,
                              "torch": sys.modules.get("torch", "absent") is None}))
    """))
    cache, pixels = tmp_path / "cache", tmp_path / "pixels.npz"
    done = subprocess.run([sys.executable, str(script), str(files["text"]), str(files["mmproj"]),
                           str(cache), str(tmp_path)], capture_output=True, text=True,
                          cwd=gguf_vision.REPO, env={**os.environ, "PYTHONPATH": str(gguf_vision.REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["torch"] and seen["name"] == "smolvlm-text-F32"

    # The same token ids and pixels as the checkpoint's own processor.
    want = ImagePromptProcessor.for_model(files["checkpoint"]).process(
        "User:<image><image>Hi", [_Image(images[0]), _Image(images[2])])
    assert seen["token_ids"] == want.token_ids
    with np.load(pixels) as got:
        for index, feature in enumerate(want.features):
            np.testing.assert_array_equal(got[f"arr_{index}"],
                                          feature.tensors["pixel_values"].to_array())
    # The config: the checkpoint's vision tower, connector and image token.
    from transformers import AutoConfig

    ours, theirs = (AutoConfig.from_pretrained(d) for d in (seen["dir"], files["checkpoint"]))
    assert ours.architectures == ["Idefics3ForConditionalGeneration"]
    assert (ours.scale_factor, ours.image_token_id) == (theirs.scale_factor, theirs.image_token_id)
    for key in ("image_size", "patch_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "layer_norm_eps", "hidden_act"):
        assert getattr(ours.vision_config, key) == getattr(theirs.vision_config, key), key
    source = json.loads((cache / "gguf" / seen["dir"].rsplit("/", 1)[1] /
                         "gguf_source.json").read_text())
    assert source == {"gguf_file": str(files["text"]), "mmproj_file": str(files["mmproj"])}


def test_f32_files_give_the_safetensors_checkpoints_tokens(files, f32_pair, checkpoint_tokens):
    with LLM(str(files["text"]), mmproj=str(files["mmproj"]), dtype="float32",
             max_model_len=512) as llm:
        assert llm.model_dir == f32_pair.path  # the cached conversion of the pair
        got = generate(llm, image_prompts())
        report = llm.engine_core.executor.runner.model.gguf_report
    assert got == checkpoint_tokens
    assert report.vision_tensors == 38 and report.mmproj == files["mmproj"]


def test_f16_mmproj_fills_the_vision_tower_with_the_checkpoints_weights(files, tmp_path):
    from safetensors.torch import load_file

    mmproj = gguf_vision.convert_mmproj(files["checkpoint"], tmp_path / "mmproj-F16.gguf", "f16")
    model = load_model(resolve_model(files["text"], mmproj=mmproj).path, torch.float32)
    state = load_file(files["checkpoint"] / "model.safetensors")
    ours = dict(model.named_parameters())
    vision = {name: ours[name.removeprefix("model.")] for name in state
              if name.startswith(("model.vision_model.", "model.connector."))}
    assert len(vision) == 38
    for name, param in vision.items():
        # llama.cpp keeps the embeddings (patch conv, positions) and 1-D tensors in F32
        f32 = ".embeddings." in name or param.dim() == 1
        want = state[name] if f32 else state[name].half().float()
        torch.testing.assert_close(param, want, atol=0, rtol=0, msg=name)


@pytest.mark.skipif(gguf_vision.missing_quantize() is not None,
                    reason=gguf_vision.missing_quantize() or "")
def test_q8_0_text_gguf_stays_packed_and_matches_transformers(files, tmp_path):
    from transformers import AutoModelForCausalLM, Idefics3ForConditionalGeneration

    text = gguf_vision.quantize(files["text"], tmp_path / "smolvlm-text-Q8_0.gguf", "Q8_0")
    with LLM(str(text), mmproj=str(files["mmproj"]), dtype="float32",
             max_model_len=512) as llm:
        got = generate(llm, image_prompts())
        report = llm.engine_core.executor.runner.model.gguf_report
        processor = llm._image_processor()
    # 14 linears, the embedding and the lm_head as int8 blocks; the vision tower dense
    assert dict(report.repacked_types) == {"Q8_0": 16} and report.vision_tensors == 38
    # transformers' Idefics3 on the checkpoint, its language model replaced by what
    # transformers itself dequantizes from the Q8_0 file
    hf_model = Idefics3ForConditionalGeneration.from_pretrained(
        files["checkpoint"], dtype=torch.float32).eval()
    dequantized = AutoModelForCausalLM.from_pretrained(text.parent, gguf_file=text.name,
                                                       dtype=torch.float32)
    hf_model.model.text_model.load_state_dict(dequantized.model.state_dict())
    hf_model.lm_head.load_state_dict(dequantized.lm_head.state_dict())
    ref = gguf_vision.hf_image_reference(hf_model, processor, image_prompts(), NUM_NEW_TOKENS)
    assert assert_greedy_matches(got, ref, max_gap=NEAR_TIE_LOGPROB_GAP) <= 1


def test_serve_with_mmproj_answers_an_image(files, f32_pair, checkpoint_tokens):
    """`pagedserve serve --model X.gguf --mmproj Y.gguf` (its torch-free frontend, the
    engine core in its own process): the chat answer is the checkpoint's (its template
    renders image_prompts()[0])."""
    import base64
    import io

    import openai
    from transformers import AutoTokenizer

    from tests.support.server_fixtures import ServerProcess, serving

    image = sample_images()[0]
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    tokenizer = AutoTokenizer.from_pretrained(f32_pair.path)
    want = tokenizer.decode(checkpoint_tokens[0], skip_special_tokens=True)
    args = ["--model", str(files["text"]), "--mmproj", str(files["mmproj"]), "--port", "0",
            "--dtype", "float32", "--max-model-len", "512"]
    with serving(ServerProcess(args, env={"PAGEDSERVE_CACHE": str(files["cache"])})) as proc:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == ["smolvlm-text-F32"]
            reply = client.chat.completions.create(
                model="smolvlm-text-F32", messages=messages, max_tokens=NUM_NEW_TOKENS,
                temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == want


def test_a_projector_of_another_type_is_refused(files):
    with pytest.raises(ModelSourceError, match=r"projector type 'gemma3' is not supported; "
                                               r"supported: idefics3 \(SmolVLM"):
        resolve_model(files["text"], mmproj=files["stub"])


def test_mmproj_needs_the_text_gguf_it_belongs_to(files):
    mmproj = files["mmproj"]
    # a checkpoint directory, no model at all, a hub id
    with pytest.raises(ModelSourceError, match="is a checkpoint directory"):
        resolve_model(files["checkpoint"], mmproj=mmproj)
    with pytest.raises(ModelSourceError, match="no --model was given"):
        resolve_model(None, mmproj=mmproj)
    with pytest.raises(ModelSourceError, match="is not a .gguf file"):
        resolve_model("org/name", mmproj=mmproj)
    # a text-only GGUF (no <image> in its vocabulary)
    text_only = gguf_vision.REPO / "tests/data/gguf/tiny-llama-Q8_0.gguf"
    with pytest.raises(ModelSourceError, match="vocabulary has no <image> token"):
        resolve_model(text_only, mmproj=mmproj)
    # the two swapped, or a text GGUF as the mmproj
    with pytest.raises(ModelSourceError, match="is a vision projector .*pass it as --mmproj"):
        resolve_model(mmproj)
    with pytest.raises(ModelSourceError, match="not a llama.cpp vision projector"):
        resolve_model(files["text"], mmproj=text_only)
    with pytest.raises(ModelSourceError, match="is the mmproj itself"):
        resolve_model(mmproj, mmproj=mmproj)
    with pytest.raises(ModelSourceError, match="--mmproj .*: no such file"):
        resolve_model(files["text"], mmproj=files["text"].with_name("missing.gguf"))


def test_the_cli_takes_mmproj_and_reports_a_bad_pair(files, capsys):
    from server.http.cli import engine_config_from_args, main, make_arg_parser

    args = make_arg_parser().parse_args(["--model", str(files["text"]),
                                         "--mmproj", str(files["mmproj"])])
    config = engine_config_from_args(args, str(files["text"]), "m")
    assert config.model_config.mmproj == str(files["mmproj"])
    assert main(["serve", "--model", str(files["checkpoint"]),
                 "--mmproj", str(files["mmproj"])]) == 2
    assert "error: --mmproj" in capsys.readouterr().err
