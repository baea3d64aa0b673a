"""dualvllm's vLLM plugin: lockstep decoding, run inside each vLLM server.

Started with `--logits-processors dualvllm.engines.vllm_plugin.processor:LockstepProcessor` (the
launcher adds it for `--lockstep`). At every decode step the processor sends the top-k
of each row that belongs to a lockstep request to that request's coordinator, waits for
the chosen tokens, and masks every other logit, so the server generates, natively and
with its own KV cache, exactly the tokens the coordinator sampled from q*. Requests
without its arguments are left alone.

Not registered as a `vllm.logits_processors` entry point on purpose: vLLM loads every
installed entry point into every server, and a server with any custom logits processor
refuses speculative decoding, so installing dualvllm would break unrelated servers.

This package imports only numpy here; `processor` (V1 model runner) and `processor_v2`
(Model Runner V2) add torch and vllm, and are imported by the server only. `wire` is the
message format both sides share; `link` is the plugin's TCP connection to a coordinator.
`spin` is a `vllm.general_plugins` entry point that lowers the engine core's busy-wait in
lockstep servers only (inert unless the launcher sets its variable).
"""
