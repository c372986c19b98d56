"""The InferenceService API: the spec's models and vocabularies (:mod:`.values`,
:mod:`.base`, :mod:`.settings`, :mod:`.models`; the pod overlay, rollout and pod IDs in
:mod:`.pods`, the HTTPRoute in :mod:`.routes`, duration strings in :mod:`.durations`),
the deprecated forms still read and their warnings (:mod:`.deprecations`), parsing with
errors that say what to fix (:mod:`.parse`), the status the operator reports
(:mod:`.status`), how a service's Prometheus series are picked out (:mod:`.series`), and
defensive reads of API bodies (:mod:`.fields`).

Pure: imports the standard library, pydantic and the contract package only; every
other room of the operator may import it.
"""
