"""How one InferenceService's Prometheus series are picked out.

The chart's ServiceMonitor (``templates/servicemonitor.yaml``) labels every series
it scrapes with ``inferenceservice`` (and ``pool``); Prometheus adds ``namespace``.
The planner's queries and the dashboards select a service's series with these labels.
"""

from __future__ import annotations

DEFAULT_SELECTOR = 'namespace="{namespace}",inferenceservice="{name}"'
"""PromQL label matchers for one InferenceService's worker and router series;
``{namespace}`` and ``{name}`` are filled in. A Prometheus that scrapes another way
sets ``AutoscaleConfig.selector_template`` instead."""
