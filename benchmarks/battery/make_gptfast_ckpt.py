"""A random-weights checkpoint for gpt-fast's generate.py (pytorch-labs/gpt-fast), so that its
decode loop can be profiled and tuned as it is, with no weights downloaded. gpt-fast's model
comes from the checkout named on the command line (its code is not copied here); the model is
built from a config name of its model.py, as generate.py builds it, and saved where generate.py
looks: OUT/NAME/model.pth, with OUT/NAME/tokenizer.model beside it (generate.py asserts one;
written where sentencepiece imports: every id of the vocabulary a piece of its own, so any token
a random model picks decodes).

    git clone https://github.com/pytorch-labs/gpt-fast /tmp/gpt-fast   # elsewhere; not committed
    python benchmarks/battery/make_gptfast_ckpt.py /tmp/gpt-fast --out /tmp/gptfast-ckpt
    python /tmp/gpt-fast/generate.py --checkpoint_path /tmp/gptfast-ckpt/stories110M/model.pth \
        --prompt 16 --max_new_tokens 128 --num_samples 3 --temperature 0 --top_k 1
"""

import argparse
import importlib.util
from pathlib import Path

import torch


def gptfast_model(checkout: Path):
    """gpt-fast's model.py, imported from its checkout by path."""
    path = checkout / "model.py"
    if not path.is_file():
        raise SystemExit(f"gptfast_dir: no model.py in {checkout}; pass the root of a gpt-fast checkout")
    spec = importlib.util.spec_from_file_location("gptfast_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_tokenizer(path: Path, vocab_size: int) -> bool:
    """A SentencePiece model whose every id is a piece: <unk>, <s>, </s>, then t3, t4, ...
    False where sentencepiece (and its protobuf) does not import."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as sp
    except ImportError:
        return False
    proto = sp.ModelProto()
    proto.trainer_spec.model_type = sp.TrainerSpec.UNIGRAM
    proto.trainer_spec.vocab_size = vocab_size
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 0, 1, 2
    proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = True
    kinds = [("<unk>", sp.ModelProto.SentencePiece.UNKNOWN)]
    kinds += [("<s>", sp.ModelProto.SentencePiece.CONTROL), ("</s>", sp.ModelProto.SentencePiece.CONTROL)]
    kinds += [(f"\u2581t{i}", sp.ModelProto.SentencePiece.NORMAL) for i in range(3, vocab_size)]
    for piece, kind in kinds:
        proto.pieces.add(piece=piece, score=0.0, type=kind)
    path.write_bytes(proto.SerializeToString())
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gptfast_dir", type=Path, help="the root of a gpt-fast checkout (its model.py)")
    parser.add_argument("--out", type=Path, default=Path("checkpoints"), help="where NAME/model.pth goes")
    parser.add_argument("--name", default="stories110M", help="a config name of gpt-fast's model.py")
    args = parser.parse_args()

    model_py = gptfast_model(args.gptfast_dir)
    if args.name not in model_py.transformer_configs:
        names = ", ".join(model_py.transformer_configs)
        raise SystemExit(f"--name: {args.name!r} is not a config of gpt-fast's model.py; one of {names}")
    torch.manual_seed(0)
    model = model_py.Transformer.from_name(args.name).to(torch.bfloat16)
    folder = args.out / args.name  # generate.py picks the config by this folder's name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pth")
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {folder / 'model.pth'}: {args.name}, {params / 1e6:.1f}M random bf16 parameters")
    if write_tokenizer(folder / "tokenizer.model", model.config.vocab_size):
        print(f"wrote {folder / 'tokenizer.model'}: {model.config.vocab_size} pieces")
    else:
        print("no tokenizer.model written: sentencepiece does not import (generate.py needs one)")


if __name__ == "__main__":
    main()
