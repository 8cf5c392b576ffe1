"""The score rules, described once (docs/architecture.rst).

:mod:`.visibility` holds :class:`~.visibility.Rules` (positions, visibility,
key ranges, block classification) and its Array-API lowering; :mod:`.online`
the online-softmax and log-sum-exp helpers; :mod:`.dropout` the Philox
counters; :mod:`.merge` the exact merge of partial results.
"""
