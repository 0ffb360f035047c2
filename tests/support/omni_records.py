"""Records and checks shared by the Qwen-Omni tests (``test_family_qwen_omni.py``,
``test_family_qwen3_omni.py``): random conversations with WAV / array audio and images, videos as
frame lists at many frame rates, and the packed-vs-separate forward. WAV files are written with
the stdlib ``wave`` module.
"""

from __future__ import annotations

import random
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from neatpack.pipes.collating.mask import to_4d_additive_mask
from neatpack.pipes.families import tokenize_with_handler
from neatpack.pipes.families.processor_compat import video_token_counts
from neatpack.pipes.families.qwen_omni import qwen_omni_pack_media
from neatpack.pipes.materializing.pack import build_pack
from neatpack.pipes.reading.media import SampleError
from support.family_checks import label_spans, runs
from support.versions import knows_its_media_ids

WORDS = (
    "the", "cat", "sat", "on", "a", "mat", "while", "data", "flows", "through", "every",
    "packed", "row", "of", "tokens", "and", "sounds", "return", "value",
)  # fmt: skip
RATE = 16000


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, channels: int = 1) -> Path:
    """16-bit PCM WAV of ``samples`` (floats in [-1, 1]; ``[n, channels]`` when channels > 1)."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path


def _wave_form(rng: random.Random, n: int) -> np.ndarray:
    t = np.arange(n) / RATE
    return (0.3 * np.sin(2 * np.pi * rng.uniform(100, 900) * t)).astype(np.float32)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def _record(sid: int, rng: random.Random, tmp: Path) -> dict[str, Any]:
    """1-3 turns; each user turn has 0-2 audio clips (WAV file or array, 0.05-4 s), 0-1 image."""
    conv: list[dict[str, Any]] = []
    images_meta: list[list[int]] = []
    audios_meta: list[float] = []
    if rng.random() < 0.4:
        conv.append({"role": "system", "content": [{"type": "text", "text": _text(rng, 2, 8)}]})
    for turn in range(rng.randint(1, 3)):
        user: list[dict[str, Any]] = []
        for k in range(rng.randint(0, 2)):
            n = rng.randint(800, 4 * RATE)
            wav = _wave_form(rng, n)
            if rng.random() < 0.5:
                src: Any = str(write_wav(tmp / f"s{sid}_{turn}_{k}.wav", wav))
            else:
                src = wav
            user.append({"type": "audio", "audio": src, "_seconds": n / RATE})
        if rng.random() < 0.5:
            h, w = rng.randint(28, 120), rng.randint(28, 120)
            user.append(
                {"type": "image", "image": Image.new("RGB", (w, h), (rng.randint(0, 255), 9, 9))}
            )
        rng.shuffle(user)
        for b in user:  # metadata in block order
            if b["type"] == "audio":
                audios_meta.append(b.pop("_seconds"))
            else:
                images_meta.append([b["image"].height, b["image"].width])
        user.append({"type": "text", "text": _text(rng, 2, 20)})
        conv.append({"role": "user", "content": user})
        conv.append({"role": "assistant", "content": [{"type": "text", "text": _text(rng, 1, 25)}]})
    return {"sample_id": sid, "conversation": conv, "images_meta": images_meta,
            "audios_meta": audios_meta}  # fmt: skip


def _records(n: int, seed: int, tmp: Path) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_record(i, rng, tmp) for i in range(n)]


def _blocks(rec: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [b for m in rec["conversation"] for b in m["content"] if b.get("type") == kind]


def check_assistant_labels(proc: Any, recs: list[dict[str, Any]]) -> None:
    """Each record's labels decode to exactly its assistant turns (+ ``<|im_end|>``), no media
    token is labelled and the attention mask is all ones."""
    for rec in recs:
        s = tokenize_with_handler(rec, proc)
        want = [m["content"][0]["text"] + "<|im_end|>" for m in rec["conversation"]
                if m["role"] == "assistant"]  # fmt: skip
        assert label_spans(proc.tokenizer, s) == want, rec["sample_id"]
        assert bool((s["labels"][s["mm_token_type_ids"] != 0] == -100).all())
        assert s["attention_mask"].tolist() == [1] * len(s["input_ids"])


def _runs(s: dict[str, Any], code: int) -> list[int]:
    """Lengths of the maximal runs of token type ``code``, in order."""
    return runs(s["mm_token_type_ids"].tolist(), code)


def _frames(n: int, w: int = 40, h: int = 60, shade: int = 0) -> list[Image.Image]:
    return [Image.new("RGB", (w, h), ((40 * k + shade) % 256, 9, 200)) for k in range(n)]


def video_records() -> list[dict[str, Any]]:
    """Videos of 2-8 frames at fps None (processor default), 0.5 ... 29.97, some with an image
    and audio in the same turn, one given as ``videos_meta`` only."""
    rng = random.Random(21)
    recs: list[dict[str, Any]] = []
    for sid, fps in enumerate((None, 0.5, 1.0, 2.0, 3.0, 7.0, 24.0, 29.97)):
        n = (4, 2, 6, 4, 4, 6, 2, 8)[sid]  # each frame pair costs >= 128 tokens (processor)
        video: dict[str, Any] = {"type": "video", "video": _frames(n, shade=sid)}
        if fps is not None:
            video["fps"] = fps
        user: list[dict[str, Any]] = [video]
        if sid % 2:
            user.append({"type": "audio", "audio": _wave_form(rng, rng.randint(900, 3 * RATE))})
        if sid % 3 == 0:
            user.insert(0, {"type": "image", "image": Image.new("RGB", (60, 40), (9, 9, sid))})
        user.append({"type": "text", "text": _text(rng, 2, 8)})
        answer = {"role": "assistant", "content": [{"type": "text", "text": _text(rng, 1, 9)}]}
        recs.append({"sample_id": 500 + sid, "conversation": [
            {"role": "user", "content": user}, answer]})  # fmt: skip
    return recs


def _audio_rec(sid: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"sample_id": sid, "conversation": [
        {"role": "user", "content": [block, {"type": "text", "text": "listen"}]},
        {"role": "assistant", "content": "ok"}]}  # fmt: skip


def check_videos(
    proc: Any, tokenize: Any, estimate: Any, default_fps: float, refused: tuple[float, ...] = ()
) -> None:
    """Video tokens == grid / merge**2 == the processor's ``_get_num_multimodal_tokens``;
    ``video_second_per_grid`` == 2 / fps; labels == the assistant turn; exact estimate == real
    length with ``videos_meta`` and from the frames; the token types == the processor's.
    Videos at an fps in ``refused`` must be a SampleError naming the sample."""
    for rec in video_records():
        if _blocks(rec, "video")[0].get("fps") in refused:
            with pytest.raises(SampleError, match=rf"sample_id={rec['sample_id']} \[bad_media\]"):
                tokenize(rec, proc)
            continue
        s = tokenize(rec, proc)
        videos = _blocks(rec, "video")
        sizes = [[len(v["video"]), v["video"][0].height, v["video"][0].width] for v in videos]
        want = video_token_counts(proc, sizes)
        assert _runs(s, 2) == list(want) == (s["video_grid_thw"].prod(-1) // 4).tolist()
        fps = videos[0].get("fps", default_fps)
        assert s["video_second_per_grid"].tolist() == pytest.approx([2 / fps])
        want_text = [rec["conversation"][1]["content"][0]["text"] + "<|im_end|>"]
        assert label_spans(proc.tokenizer, s) == want_text
        real = len(s["input_ids"]) - 1
        assert estimate(rec, proc) == real
        meta = {**rec, "videos_meta": [[*size, fps] for size in sizes]}
        meta["conversation"] = [dict(m, content=[dict(b, video="clip.mp4") if b["type"] == "video"
                                                 else b for b in m["content"]])
                                for m in rec["conversation"]]  # fmt: skip
        assert estimate(meta, proc) == real
        if not knows_its_media_ids(proc):  # transformers 5.17: it marks nothing
            continue
        theirs = proc.create_mm_token_type_ids(s["input_ids"][None].tolist())
        assert torch.equal(torch.as_tensor(theirs)[0].long(), s["mm_token_type_ids"])


def parity_records(
    tmp_path: Path, wav_samples: int, red: tuple[int, int], green: tuple[int, int]
) -> list[dict[str, Any]]:
    """The packing-parity documents: audio (a WAV of ``wav_samples``) + a ``red`` image, text
    only, a ``green`` image + two array clips (7000 and 23456 samples); sizes are ``(w, h)``."""
    rng = random.Random(6)
    a = str(write_wav(tmp_path / "p.wav", _wave_form(rng, wav_samples)))
    red_im, green_im = Image.new("RGB", red, (200, 9, 9)), Image.new("RGB", green, (9, 200, 9))
    return [
        {"sample_id": 0, "conversation": [
            {"role": "user", "content": [{"type": "audio", "audio": a},
                                         {"type": "image", "image": red_im},
                                         {"type": "text", "text": "what do you hear and see?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a tone and red"}]}]},
        {"sample_id": 1, "conversation": [
            {"role": "user", "content": [{"type": "text", "text": "just words here"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "fine"}]}]},
        {"sample_id": 2, "conversation": [
            {"role": "user", "content": [{"type": "image", "image": green_im},
                                         {"type": "audio", "audio": _wave_form(rng, 7000)},
                                         {"type": "text", "text": "and these?"},
                                         {"type": "audio", "audio": _wave_form(rng, 23456)}]},
            {"role": "assistant", "content": [{"type": "text", "text": "two more sounds"}]}]},
    ]  # fmt: skip


def packed_vs_separate(
    model: Any, samples: list[dict[str, Any]], positions: Any, *, controls: bool = False
) -> float:
    """Max abs logit diff between one packed row (``positions(sample)`` per document, 4D
    block-causal mask, ``qwen_omni_pack_media``) and each document alone (the model computing
    its own positions from a 2-D mask). With ``controls``, each of these must move the packed
    logits by > 1e-3: a one-document mask, 1-D positions instead of mRoPE, zeroed audio
    features (the samples must hold audio)."""
    docs = [dict(s, position_ids=positions(s)) for s in samples]
    pack = build_pack(docs, mrope=True)
    media = qwen_omni_pack_media(samples)
    doc = pack["attention_mask"][None]

    def run(mask: torch.Tensor, **over: Any) -> torch.Tensor:
        with torch.no_grad():
            return model(  # type: ignore[no-any-return]
                input_ids=pack["input_ids"][None], attention_mask=mask,
                **{"position_ids": pack["position_ids"][:, None], **media, **over},
            ).logits[0]  # fmt: skip

    packed = run(to_4d_additive_mask(doc))
    worst, start = 0.0, 0
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
            "video_second_per_grid", "input_features", "feature_attention_mask")  # fmt: skip
    for s, n in zip(samples, pack["seq_lens"], strict=True):
        ids = s["input_ids"][:-1][None]
        kw = {k: s[k] for k in keys if k in s}
        with torch.no_grad():  # the 2-D mask makes the model compute its own mRoPE
            alone = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kw).logits[0]
        worst = max(worst, float((packed[start : start + n] - alone).abs().max()))
        start += n
    if controls:
        mask = to_4d_additive_mask(doc)
        flat = pack["text_position_ids"][None, None].expand(3, 1, -1)  # 1-D: not Omni's
        silent = torch.zeros_like(media["input_features"])
        for moved in (run(to_4d_additive_mask((doc > 0).long())), run(mask, position_ids=flat),
                      run(mask, input_features=silent)):  # fmt: skip
            assert float((moved - packed).abs().max()) > 1e-3
    return worst
