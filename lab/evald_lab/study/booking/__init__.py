"""``engine-adapter study --problems booking``: the booking-policy study of issue 46.

The customer messages and their known outcomes (:mod:`.messages`), the policy as code and as
the ``booking_policy`` evaluator (:mod:`.policy`), the arms' schemas and prompts (:mod:`.arms`),
the rule-based scoring (:mod:`.scoring`), the records (:mod:`.records`), the runner and its
generation interface (:mod:`.runner`, :mod:`.generation`), and the summary, table and plot
(:mod:`.report`).
"""

__all__: list[str] = []
