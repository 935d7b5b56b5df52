"""Cosmos3 adapter: SGLang request builder / response decoder (io) and the `cosmos3` policy."""

from wamkit.policies.cosmos3.io import (build_cosmos3_request, cosmos3_action_pipeline, cosmos3_image,  # noqa: F401
                                        cosmos3_parameters, cosmos3_prompt, decode_cosmos3_actions,
                                        decode_cosmos3_response)
