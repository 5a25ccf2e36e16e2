"""``megatron.training.async_utils`` as in Megatron-LM main, over a fake queue with known durations."""

import time

from megatron.training import get_args

CHECK_S = 0.02  # the non-blocking is_done check (a collective) and finalize fns, on the training thread
WRITE_S = 0.05  # what a blocking finalize waits for the background write
SHUTDOWN_S = 0.5  # close(): joining the async worker, after the write has ended


class FakeAsyncCallsQueue:
    def __init__(self):
        self.calls = []  # True once the background write of that call has finished
        self.closed = False

    def schedule_async_request(self):
        self.calls.append(False)
        return len(self.calls) - 1

    def get_num_unfinalized_calls(self):
        return len(self.calls)

    def finish_writes(self):
        self.calls = [True for _ in self.calls]

    def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
        if not self.calls:
            return []
        if blocking:
            time.sleep(WRITE_S)
            self.finish_writes()
        time.sleep(CHECK_S)
        finalized = [i for i, done in enumerate(self.calls) if done]
        self.calls = [done for done in self.calls if not done]
        return finalized

    def close(self):
        time.sleep(SHUTDOWN_S)
        self.closed = True


_async_calls_queue = None


def schedule_async_save(async_request=None):
    global _async_calls_queue
    if _async_calls_queue is None:
        _async_calls_queue = FakeAsyncCallsQueue()
    _async_calls_queue.schedule_async_request()


def maybe_finalize_async_save(blocking: bool = False, terminate=False):
    if not get_args().async_save:
        return
    queue = _async_calls_queue
    if queue is not None:
        queue.maybe_finalize_async_calls(blocking, no_dist=False)
    if terminate and queue is not None:
        queue.close()
