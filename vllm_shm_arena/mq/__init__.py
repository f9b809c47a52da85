"""The parts ``MessageQueue`` (vllm_shm_arena/message_queue.py, the facade) is made of.

Dependencies run one way, top to bottom; no part imports message_queue.py::

    message_queue.py   MessageQueue: vLLM's interface; builds an end per role, delegates
      groups.py        the process-group constructors (take the queue class as a parameter)
      relay.py         RelayEnd: a remote node's relay (upstream reader, downstream writer)
      writer.py        WriterEnd: the send path, settling an interrupted send, the broken state
      reader.py        LocalReaderEnd / RemoteReaderEnd: ring, overflow, blobs, unpickling
      end.py           End: what every role shares; the calls of other roles fail there
      transport.py     the sockets beside the ring: handshake, sealed frames, monitor, send/recv
      admission.py     who may connect to the writer's TCP socket: the ZAP handler, the roster
      reporting.py     counters, rate-limited logs, the once-a-second reports and their timer
      lifecycle.py     pid, shutdown flag, call lock, the exit gate and hook, the finalizer
      protocol.py      the Handle, the frames and ring markers, the reader-side errors

Below them: arena.py, pickler.py, sizing.py, metrics.py, settings.py, the extension.

Private to the queue: import from ``vllm_shm_arena.message_queue``, not from here.
"""
