"""The core's output sockets (engine/core/core_proc.py, OutputSockets): the busy loop
sends each step's outputs itself, so a send must never block on a frontend that reads
slowly, and a grammar thread's reply may be sent beside the loop's without mixing."""

from __future__ import annotations

import threading

import zmq

from engine.core.core_proc import OutputSockets
from engine.ipc import Pong, frontend_codec


def bound_pull(context: zmq.Context, tmp_path, name: str) -> tuple[zmq.Socket, str]:
    socket = context.socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 8)  # the frontend's side holds only a few
    address = f"ipc://{tmp_path}/{name}.sock"
    socket.bind(address)
    return socket, address


def received(socket: zmq.Socket, count: int) -> list[int]:
    codec = frontend_codec()
    assert socket.poll(5000), "nothing arrived"
    return [codec.decode(socket.recv()).ping_id for _ in range(count)]


def test_a_send_never_blocks_on_a_frontend_that_does_not_read(tmp_path):
    context = zmq.Context()
    pull, address = bound_pull(context, tmp_path, "out")
    outputs = OutputSockets(context, [address])
    count = 5_000  # well past ZMQ's default high-water marks (1,000 each side)
    sender = threading.Thread(target=lambda: [outputs.send(Pong(i)) for i in range(count)],
                              daemon=True)
    sender.start()
    sender.join(timeout=20)
    assert not sender.is_alive(), "a send blocked while the frontend was not reading"
    assert received(pull, count) == list(range(count))  # all of them, in order
    outputs.close(0)
    pull.close(linger=0)
    context.term()


def test_two_threads_sending_at_once_deliver_every_message_whole(tmp_path):
    context = zmq.Context()
    pull, address = bound_pull(context, tmp_path, "out")
    outputs = OutputSockets(context, [address])
    per_thread = 2_000

    def send_from(first: int) -> None:
        for i in range(first, first + per_thread):
            outputs.send(Pong(i))

    threads = [threading.Thread(target=send_from, args=(k * per_thread,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    ids = received(pull, 2 * per_thread)
    assert sorted(ids) == list(range(2 * per_thread))  # each decodes: none interleaved
    for k in range(2):  # each thread's own messages keep their order
        mine = [i for i in ids if k * per_thread <= i < (k + 1) * per_thread]
        assert mine == sorted(mine)
    outputs.close(0)
    pull.close(linger=0)
    context.term()


def test_send_goes_to_one_frontend_or_to_every_one(tmp_path):
    context = zmq.Context()
    pulls, addresses = zip(*(bound_pull(context, tmp_path, f"out-{k}") for k in range(3)),
                           strict=True)
    outputs = OutputSockets(context, list(addresses))
    outputs.send(Pong(7), to=1)
    outputs.send(Pong(8))  # None: every frontend
    assert received(pulls[0], 1) == [8]
    assert received(pulls[1], 2) == [7, 8]
    assert received(pulls[2], 1) == [8]
    outputs.close(0)
    for pull in pulls:
        pull.close(linger=0)
    context.term()
