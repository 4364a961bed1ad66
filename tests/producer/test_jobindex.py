"""The job index (``producer.jobindex``) stays bounded, and pages through it newest first."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from producer import jobindex
from protocol.keys import JOB_INDEX_MAXLEN, Keys


def test_after_100000_jobs_the_index_holds_at_most_its_cap(redis_url, namespace):
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        keys = Keys(namespace)
        try:
            # Each submission queues exactly these commands on its pipeline; 500 a round trip
            # here, so 100,000 "submissions" take a second or two.
            for start in range(0, 100_000, 500):
                pipe = r.pipeline(transaction=False)
                for n in range(start, start + 500):
                    jobindex.queue_add(pipe, keys, f"job-{n:06d}", 1_000_000 + n)
                await pipe.execute()
                assert await r.zcard(keys.job_index) <= JOB_INDEX_MAXLEN
            assert await r.zcard(keys.job_index) == JOB_INDEX_MAXLEN
            newest = await r.zrevrange(keys.job_index, 0, 0)
            oldest = await r.zrange(keys.job_index, 0, 0)
            assert newest == [b"job-099999"]
            assert oldest == [f"job-{100_000 - JOB_INDEX_MAXLEN:06d}".encode()]
        finally:
            await r.delete(keys.job_index)
            await r.aclose()

    asyncio.run(main())


def test_pages_skip_ids_without_records_and_read_past_ties(redis_url, namespace):
    async def main() -> None:
        r = aioredis.Redis.from_url(redis_url)
        keys = Keys(namespace)
        try:
            pipe = r.pipeline(transaction=False)
            for n in range(6):
                job_id = f"job-{n}"
                jobindex.queue_add(pipe, keys, job_id, 1000 + n // 3)  # three jobs a ms
                if n != 4:  # job-4's record is gone
                    pipe.hset(keys.job(job_id), mapping={"model": "m", "status": "queued"})
            await pipe.execute()
            seen: list[str] = []
            cursor = None
            for _ in range(10):
                page = await jobindex.page(r, keys, limit=2, cursor=cursor)
                seen += [row["id"] for row in page.rows]
                if page.cursor is None:
                    break
                cursor = jobindex.Cursor.parse(page.cursor)
            assert sorted(seen) == ["job-0", "job-1", "job-2", "job-3", "job-5"]
            assert len(seen) == len(set(seen))
            assert seen[:2] == ["job-5", "job-3"]  # newest first
        finally:
            await r.aclose()

    asyncio.run(main())
