"""Drafters on the Hub: a model card made with huggingface_hub's `ModelCard` from the drafter's config and its benchmark
results, an upload that carries everything a drafter folder holds (weights, config, generation config, remote code,
the target's tokenizer when bound, card), and loading a drafter by folder, shipped name or Hub id."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import sys
import tempfile

from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData


CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ title }}

{{ description }}

```python
import angelspec_hf  # or AutoModel.from_pretrained(..., trust_remote_code=True) without the package
from transformers import AutoModel

drafter = AutoModel.from_pretrained("{{ repo_id }}")
output = target.generate(input_ids, assistant_model=drafter, max_new_tokens=128)
```
"""


def benchmark_results(report: dict, model_name: str) -> list[EvalResult]:
    """`EvalResult`s (τ and speedup over AR per prompt set) of a drafter's methods in an `angelspec bench` report."""
    prompts = report["prompts"]  # the prompt source the report ran on, e.g. mt_bench or spec_bench:qa
    results = []
    for method in report.get("methods", []):
        if model_name not in method["name"]:
            continue
        for metric, value in (("tau", method["tau"]), ("speedup", method["speedup"])):
            results.append(
                EvalResult(
                    task_type="text-generation",
                    dataset_type=prompts,
                    dataset_name=prompts,
                    metric_type=metric,
                    metric_name=f"{metric} ({method['name']})",
                    metric_value=round(float(value), 3),
                )
            )
    return results


def drafter_card(
    drafter,
    repo_id: str,
    reports: list[dict] | None = None,
    datasets: list[str] | None = None,
    license: str | None = None,
    description: str | None = None,
) -> ModelCard:
    """A model card for `drafter` to be pushed as `repo_id`: base model (the target), library, pipeline tag, tags,
    datasets, licence and a `model-index` from `reports` (`angelspec bench` JSON reports)."""
    config = drafter.config
    name = repo_id.rsplit("/", 1)[-1]
    results = [result for report in reports or [] for result in benchmark_results(report, name)]
    data = ModelCardData(
        base_model=config.target_name_or_path,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "angelspec", "draft-model", config.drafter_kind],
        datasets=datasets,
        license=license,
        model_name=name,
        eval_results=results or None,
    )
    target = config.target_name_or_path or "its target"
    text = description or (
        f"An AngelSpec {config.drafter_kind} drafter for {target}: pass it as `assistant_model` to the target's "
        "`generate()`; the output is the target's (speculative decoding is lossless)."
    )
    return ModelCard.from_template(
        data,
        template_str=CARD_TEMPLATE,
        title=f"AngelSpec {config.drafter_kind} drafter for {target}",
        description=text,
        repo_id=repo_id,
    )


def upload_drafter(
    drafter,
    repo_id: str,
    folder: str | None = None,
    card: ModelCard | None = None,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Create `repo_id` if needed and upload the drafter to it in one commit, saved with its remote code (the package's
    modules as they are now, so the repository loads with `trust_remote_code=True` where the package is missing) and,
    for a router, every member inside it; the other files of `folder` (card, results, training records) go with it.
    The folder's README.md is kept unless `card` is given, and `drafter_card` is written where there is none.
    Returns the commit info."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as scratch:
        staged = os.path.join(scratch, "drafter")
        if folder is not None:  # its card, results and training records beside the weights
            shutil.copytree(folder, staged)
        drafter.save_pretrained(staged, remote_code=True)  # with its code, a router with its members in it
        if card is not None or not os.path.isfile(os.path.join(staged, "README.md")):
            (card or drafter_card(drafter, repo_id)).save(os.path.join(staged, "README.md"))
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=staged,
            commit_message=commit_message or f"Upload {type(drafter).__name__}",
            revision=revision,
            create_pr=create_pr,
        )


# The drafters a normal install carries (setup.cfg's data_files put them under <prefix>/share/angelspec_hf); the
# ablations (mtp-no-ttt, dflash) stay in the repository's model_cards/, to keep the wheel small.
SHIPPED_DRAFTERS = (
    "smollm2-135m-instruct-mtp",
    "smollm2-135m-instruct-dfly",
    "smollm2-135m-instruct-suffix",
    "smollm2-135m-instruct-router",
)
PACKAGED_CARDS = "share/angelspec_hf/model_cards"


def shipped_drafter_path(name: str) -> str | None:
    """The folder of the card `name`: the repository's `model_cards/<name>` in a source checkout (an editable
    install), else the copy a normal install put under `<prefix>/share/angelspec_hf/model_cards`; None if neither."""
    checkout = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards", name)
    if os.path.isfile(os.path.join(checkout, "config.json")):
        return checkout
    try:
        distribution = importlib.metadata.distribution("angelspec_hf")
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.as_posix().endswith(f"{PACKAGED_CARDS}/{name}/config.json"):
            return os.path.dirname(str(distribution.locate_file(file)))
    return None


def resolve_drafter(name_or_path: str) -> str:
    """Where a drafter named by a user or a file lives: a folder as it is; a shipped card's name, or a clone's path to
    one (`.../model_cards/<name>`, as a LoRA adapter or a training config written in a clone records it) where that
    folder is not, the card this install ships; anything else unchanged (a Hub id)."""
    path = str(name_or_path)
    if os.path.isdir(path):
        return path
    parent, name = os.path.split(os.path.normpath(path))
    if parent and os.path.basename(parent) != "model_cards":
        return path
    return shipped_drafter_path(name) or path


def shipped_card_folder(path_or_repo_id) -> str | None:
    """The folder of the shipped card `path_or_repo_id` names (a card's name, or a clone's `.../model_cards/<name>`
    where that folder is not: `resolve_drafter`); None for anything else (a folder, a Hub id, another name)."""
    path = str(path_or_repo_id)
    folder = resolve_drafter(path)
    return folder if folder != path else None


def _list_templates(list_repo_templates):
    @functools.wraps(list_repo_templates)
    def list_shipped_or_repo_templates(repo_id, *args, **kwargs):
        folder = shipped_card_folder(repo_id)
        if folder is None:
            return list_repo_templates(repo_id, *args, **kwargs)
        from transformers.utils.hub import CHAT_TEMPLATE_DIR  # loaded: this wraps one of its functions

        templates = os.path.join(folder, CHAT_TEMPLATE_DIR)
        return (
            sorted(name for name in os.listdir(templates) if name.endswith(".jinja"))
            if os.path.isdir(templates)
            else []
        )

    return list_shipped_or_repo_templates


def _cached_files(cached_files):
    @functools.wraps(cached_files)
    def cached_shipped_or_repo_files(path_or_repo_id, *args, **kwargs):
        return cached_files(shipped_card_folder(path_or_repo_id) or path_or_repo_id, *args, **kwargs)

    return cached_shipped_or_repo_files


def resolve_shipped_names(hub_module) -> None:
    """Make a shipped card's name (`"smollm2-135m-instruct-mtp"`) work wherever transformers takes a name or path:
    `AutoConfig` / `AutoModel` / `AutoTokenizer.from_pretrained`, `pipeline(assistant_model=...)`, a LoRA adapter's
    base. transformers has no hook for names of local models, and every one of those reads its files through
    `transformers.utils.hub`'s `cached_files` (configs, weights, tokenizer and generation files) and, for a name that
    is not a folder, asks the Hub for its chat templates (`list_repo_templates`): both are wrapped so that a shipped
    name reads the shipped folder and everything else goes on as before. Every module that already holds the
    originals by name gets the wrapped ones (idempotent)."""
    for name, wrap in (("cached_files", _cached_files), ("list_repo_templates", _list_templates)):
        original = getattr(hub_module, name)
        if getattr(original, "_resolves_shipped_names", False):
            continue
        wrapped = wrap(original)
        wrapped._resolves_shipped_names = True
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("transformers") and getattr(module, name, None) is original:
                setattr(module, name, wrapped)


def is_hub_id(path: str) -> bool:
    """Whether `path` has the shape of a Hub repository id (`owner/name`), not of a relative or absolute folder."""
    return len(path.split("/")) == 2 and ".." not in path.split("/") and not os.path.isabs(path)


def load_drafter(name_or_path: str, target=None, tokenizer=None, **kwargs):
    """A drafter by folder, by the name of a shipped card (`load_drafter("smollm2-135m-instruct-mtp")`) or by Hub
    id, in eval mode, bound to `target` (and its `tokenizer`) when given; a peft LoRA adapter folder gives the
    `PeftModel` on the drafter it names as its base. `kwargs` go to `AutoModel.from_pretrained`; a folder's own code
    runs only with `trust_remote_code=True` (the package's drafters need none: a folder of an unknown `model_type`
    is refused, never asked about nor run)."""
    from transformers import AutoModel

    kwargs.setdefault("trust_remote_code", False)

    path = resolve_drafter(name_or_path)
    if not os.path.isdir(path) and not is_hub_id(path):
        raise FileNotFoundError(
            f"Drafter {name_or_path!r} is not a folder, a shipped drafter ({', '.join(SHIPPED_DRAFTERS)}) or a Hub id"
        )
    if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
        os.path.join(path, "config.json")
    ):
        from peft import PeftConfig, PeftModel  # a LoRA adapter, onto the drafter it was trained from

        base = load_drafter(PeftConfig.from_pretrained(path).base_model_name_or_path, **kwargs)
        drafter = PeftModel.from_pretrained(base, path).eval()
    else:
        drafter = AutoModel.from_pretrained(path, **kwargs).eval()
    if target is not None:
        drafter.bind_target(target, tokenizer)
    return drafter
