"""Resumable JSONL batch generation: the engine room of `dualvllm generate`.

Input: one JSON object per line with a prompt, either `"prompt"` (text or token ids) or
both `"theta_prompt"` and `"t_prompt"`; an optional `"id"` (default: the line number);
any other keys are carried into the output under `"metadata"`.

Output: one line per finished prompt, flushed as it finishes. Rerunning the same
command skips ids already in the output, so a crash or a killed server loses nothing
and duplicates nothing. Prompts that failed are not written (a rerun retries them).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dualvllm.coordinator.core import DualVLLMCoordinator
from dualvllm.coordinator.outputs import GenerationOutput, Prompt
from dualvllm.coordinator.sequence import SamplingParams
from dualvllm.coordinator.prompts import prompt_problem
from dualvllm.common.errors import InputFormatError, InvalidInputError
from dualvllm.common.jsonl import read_objects

PROMPT_KEYS = ("prompt", "theta_prompt", "t_prompt")


@dataclass(frozen=True)
class Job:
    id: str
    prompt: Prompt
    metadata: dict[str, Any]


@dataclass
class JobReport:
    total: int  # records in the input
    skipped: int  # already in the output before this run
    written: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, error)


def read_jobs(path: Path) -> list[Job]:
    """Parse and validate the whole input before any server time is spent."""
    jobs: list[Job] = []
    seen: dict[str, int] = {}
    for number, record in read_objects(path):
        job = _parse_record(str(path), number, record)
        if job.id in seen:
            raise InputFormatError(
                str(path), number, f"id {job.id!r} already used on line {seen[job.id]}; ids must be unique"
            )
        seen[job.id] = number
        jobs.append(job)
    if not jobs:
        raise InvalidInputError(f'{path} has no prompts; expected JSON lines like {{"prompt": "..."}}')
    return jobs


def _parse_record(path: str, number: int, record: dict[str, Any]) -> Job:
    if "prompt" in record:
        prompt: Any = record["prompt"]
    elif "theta_prompt" in record and "t_prompt" in record:
        prompt = (record["theta_prompt"], record["t_prompt"])
    else:
        raise InputFormatError(path, number, 'needs "prompt", or both "theta_prompt" and "t_prompt"')
    problem = prompt_problem(prompt)
    if problem is not None:
        raise InputFormatError(path, number, problem)
    job_id = record.get("id", number)
    if not isinstance(job_id, (str, int)) or isinstance(job_id, bool):
        raise InputFormatError(path, number, '"id" must be a string or an integer')
    metadata = {k: v for k, v in record.items() if k not in PROMPT_KEYS and k != "id"}
    return Job(id=str(job_id), prompt=prompt, metadata=metadata)


def check_output(path: Path, *, input_path: Path) -> None:
    """Refuse an output that cannot be appended to, before any server starts."""
    if path.exists() and input_path.exists() and path.samefile(input_path):
        raise InvalidInputError(
            f"--output {path} is the input file; results would be appended to the prompts. Give another path"
        )
    if path.is_dir():
        raise InvalidInputError(f"--output {path} is a directory; give a file path (e.g. {path / 'out.jsonl'})")
    folder = next(p for p in path.absolute().parents if p.exists())
    if not folder.is_dir():
        raise InvalidInputError(
            f"cannot write the output {path}: {folder} is a file, not a folder; choose another path"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise InvalidInputError(
            f"cannot write the output {path}: {exc.strerror or exc}; choose a writable path"
        ) from exc


def done_ids(path: Path) -> set[str]:
    """Ids already in the output. A torn last line (the writer was killed mid-line) is cut off."""
    if not path.exists():
        return set()
    ids: set[str] = set()
    good_bytes = 0
    with open(path, "rb") as output:
        for raw in output:
            if not raw.endswith(b"\n"):
                break
            try:
                ids.add(str(json.loads(raw)["id"]))
            except (ValueError, KeyError, TypeError):
                break
            good_bytes += len(raw)
    if good_bytes != path.stat().st_size:
        with open(path, "rb+") as output:
            output.truncate(good_bytes)
    return ids


def job_seed(seed: int, job_id: str) -> int:
    """A per-prompt seed from the run seed and the prompt's id, stable across reruns."""
    digest = hashlib.blake2b(f"{seed}:{job_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


async def run_jobs(
    coordinator: DualVLLMCoordinator,
    input_path: Path,
    output_path: Path,
    params: SamplingParams,
    *,
    seed: int,
    show_progress: bool = True,
) -> JobReport:
    jobs = read_jobs(input_path)
    finished = done_ids(output_path)
    pending = [job for job in jobs if job.id not in finished]
    report = JobReport(total=len(jobs), skipped=len(jobs) - len(pending))
    if not pending:
        return report
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out:
        async for output in coordinator.stream(
            [job.prompt for job in pending],
            params,
            seeds=[job_seed(seed, job.id) for job in pending],
            show_progress=show_progress,
        ):
            job = pending[output.index]
            if not output.ok:
                report.failed.append((job.id, output.error or "unknown error"))
                continue
            out.write(json.dumps(_record(job, output)) + "\n")
            out.flush()  # a killed process keeps every line written so far
            report.written += 1
    return report


def _record(job: Job, output: GenerationOutput) -> dict[str, Any]:
    record = output.to_dict()
    del record["index"], record["error"]
    return {"id": job.id, **record, "metadata": job.metadata}
