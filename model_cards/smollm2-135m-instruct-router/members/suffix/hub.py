"""Drafters on the Hub: a model card made with huggingface_hub's `ModelCard` from the drafter's config and its benchmark
results, and an upload that carries everything a drafter folder holds (weights, config, generation config, remote
code, the target's tokenizer when bound, card)."""

from __future__ import annotations

import os
import shutil
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
    """Create `repo_id` if needed and upload a drafter folder to it in one commit: `folder` as saved, or (None) the
    drafter saved afresh; the folder's README.md is kept unless `card` is given, and `drafter_card` is written where
    there is none. Returns the commit info."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as scratch:
        staged = os.path.join(scratch, "drafter")
        if folder is None:
            drafter.save_pretrained(staged)
        else:
            shutil.copytree(folder, staged)
        if card is not None or not os.path.isfile(os.path.join(staged, "README.md")):
            (card or drafter_card(drafter, repo_id)).save(os.path.join(staged, "README.md"))
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=staged,
            commit_message=commit_message or f"Upload {type(drafter).__name__}",
            revision=revision,
            create_pr=create_pr,
        )
