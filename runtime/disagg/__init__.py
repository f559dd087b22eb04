"""Disaggregated serving: the remote-prefill protocol, in one place.

- messages.py: the internal calls (router → decode GenerateCall, decode → prefill PrefillCall).
- decode.py:   the decode worker's half: one RemotePrefill state machine per request, from the
               KV reservation to K/V in place, with the failure policy (retry, local, fail).
- prefill.py:  the prefill worker's half: run the prompt, stream each layer's K/V, send DONE
               with the first token.

The engine calls both halves through engine.KVConnector; the bytes move through runtime/kv
(wire format, sender, receiver). The HTTP apps that expose them are in server/split.py.
"""
