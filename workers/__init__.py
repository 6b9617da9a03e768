"""Workers: the inference engine (scheduler, model runner, sampler, detokenizer).

Other packages import only `workers.api.types`.
"""
