"""Input parsing, resume bookkeeping and seeds of `dualvllm generate` (no servers)."""

from __future__ import annotations

import json

import pytest

from dualvllm.common.errors import InputFormatError, InvalidInputError
from dualvllm.jsonl_job import done_ids, job_seed, read_jobs


def write(tmp_path, text: str):
    path = tmp_path / "in.jsonl"
    path.write_text(text)
    return path


def test_jobs_take_ids_prompts_pairs_and_carry_metadata(tmp_path):
    path = write(tmp_path, '{"id": "a", "prompt": "12+34=", "answer": "64"}\n\n'
                           '{"prompt": [1, 2, 3]}\n{"id": 7, "theta_prompt": "x", "t_prompt": "hint: x"}\n')
    jobs = read_jobs(path)
    assert [j.id for j in jobs] == ["a", "3", "7"]  # default id: the line number
    assert jobs[0].prompt == "12+34=" and jobs[0].metadata == {"answer": "64"}
    assert jobs[1].prompt == [1, 2, 3]
    assert jobs[2].prompt == ("x", "hint: x")


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"text": "hi"}', 'needs "prompt"'),
    ('{"theta_prompt": "x"}', 'needs "prompt"'),
    ('{"prompt": ""}', "the prompt is empty"),
    ('{"prompt": [1, -2]}', r"a non-empty list of token ids \(ints >= 0\).*got \[1, -2\]"),
    ('{"prompt": "x", "id": [1]}', '"id" must be'),
])
def test_malformed_lines_are_named_by_number(tmp_path, line, problem):
    path = write(tmp_path, '{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(InputFormatError, match=problem) as info:
        read_jobs(path)
    assert info.value.line_number == 2 and str(info.value).startswith(f"{path}:2:")


def test_duplicate_ids_and_empty_files_are_refused(tmp_path):
    with pytest.raises(InputFormatError, match="already used on line 1"):
        read_jobs(write(tmp_path, '{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n'))
    with pytest.raises(InvalidInputError, match="no prompts"):
        read_jobs(write(tmp_path, "\n\n"))


def test_done_ids_cuts_a_torn_last_line_so_appends_stay_valid(tmp_path):
    out = tmp_path / "out.jsonl"
    assert done_ids(out) == set()
    out.write_text(json.dumps({"id": "a"}) + "\n" + json.dumps({"id": "b"}) + "\n" + '{"id": "c", "gen')
    assert done_ids(out) == {"a", "b"}
    assert out.read_text().endswith('{"id": "b"}\n')


def test_job_seeds_are_stable_and_distinct():
    assert job_seed(0, "a") == job_seed(0, "a")
    assert len({job_seed(0, "a"), job_seed(0, "b"), job_seed(1, "a")}) == 3


async def test_failed_prompts_are_not_written_and_a_rerun_completes_without_duplicates(tmp_path, fake_theta, fake_t):
    from dualvllm.coordinator import CoordinatorConfig, DualVLLMCoordinator, SamplingParams
    from dualvllm.jsonl_job import run_jobs
    from tests.fake_vllm import Failure

    source = write(tmp_path, "".join(json.dumps({"id": f"j{i}", "prompt": "abc"}) + "\n" for i in range(6)))
    out = tmp_path / "out.jsonl"
    config = CoordinatorConfig(theta_url=fake_theta.url, t_url=fake_t.url, top_k=8, max_batch_size=2,
                               max_retries=0, retry_delay=0.0)
    async with DualVLLMCoordinator(config) as c:
        # The teacher "dies" for one step: the two sequences it carried fail, nothing else.
        fake_t.fail_next("/v1/completions", Failure(0), Failure(503, "server killed"))
        first = await run_jobs(c, source, out, SamplingParams(3), seed=1, show_progress=False)
        assert first.written == 4 and len(first.failed) == 2 and len(done_ids(out)) == 4
        assert all("503" in error and "server killed" in error for _, error in first.failed)
        second = await run_jobs(c, source, out, SamplingParams(3), seed=1, show_progress=False)
    assert second.skipped == 4 and second.written == 2 and not second.failed
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == [f"j{i}" for i in range(6)]
