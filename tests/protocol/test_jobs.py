"""The job record's codec keeps a webhook, and a record tells what it was in each earlier
status of its fixed path."""

from __future__ import annotations

from dataclasses import replace

from protocol.jobs import (
    FINAL_STATUSES,
    JOB_ID_LENGTH,
    JOB_ID_RANDOM_BYTES,
    JobRecord,
    JobStatus,
    job_id_issued_ms,
    job_id_key,
    new_job_id,
)

DONE = JobRecord(
    id="j",
    model="m",
    version="1",
    status=JobStatus.SUCCEEDED,
    created_ms=1,
    deadline_ms=9,
    started_ms=2,
    finished_ms=3,
    result=b"r",
    webhook="https://example.com/hook?token=t",
    webhook_events=("running", "succeeded"),
)


def wire(record: JobRecord) -> dict[bytes, bytes]:
    return {
        k.encode(): str(v).encode() if not isinstance(v, bytes) else v
        for k, v in record.to_fields().items()
    }


def test_a_webhook_survives_the_codec_and_a_job_without_one_stores_no_webhook_fields():
    assert JobRecord.from_fields(wire(DONE)) == DONE
    plain = replace(DONE, webhook="", webhook_events=())
    assert "webhook" not in plain.to_fields()
    assert JobRecord.from_fields(wire(plain)) == plain


def test_each_status_knows_the_path_that_led_to_it():
    assert [s.value for s in JobStatus.SUCCEEDED.path] == ["queued", "running", "succeeded"]
    assert [s.value for s in JobStatus.EXPIRED.path] == ["queued", "expired"]
    assert JobStatus.QUEUED.path == (JobStatus.QUEUED,)
    assert set(FINAL_STATUSES) == {s for s in JobStatus if s.final}


def test_a_record_as_it_was_in_an_earlier_status_lacks_what_later_moves_set():
    running = DONE.at(JobStatus.RUNNING)
    assert (running.status, running.started_ms, running.finished_ms, running.result) == (
        JobStatus.RUNNING,
        2,
        0,
        b"",
    )
    queued = DONE.at(JobStatus.QUEUED)
    assert (queued.started_ms, queued.webhook) == (0, DONE.webhook)
    assert DONE.at(JobStatus.SUCCEEDED) is DONE


def test_a_job_id_tells_its_issue_time_only_to_the_key_that_made_it() -> None:
    key, other = job_id_key("deployment"), job_id_key("another")
    job_id = new_job_id(1_796_000_000_000, bytes(range(JOB_ID_RANDOM_BYTES)), key)
    assert len(job_id) == JOB_ID_LENGTH
    assert job_id_issued_ms(job_id, key) == 1_796_000_000_000
    assert job_id_issued_ms(job_id, other) is None  # a forgery, or another deployment's id
    flipped = job_id[:10] + ("A" if job_id[10] != "A" else "B") + job_id[11:]
    assert job_id_issued_ms(flipped, key) is None  # a typo
    assert job_id_issued_ms("A" * 22, key) is None  # the format issued before
