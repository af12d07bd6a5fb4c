package picker

// splitDecision says why a pick split its request or did not
// (disaggregation): the decision label of tally_split_decisions_total.
type splitDecision string

const (
	// splitDecisionSplit: its prefill runs on a prefill pod.
	splitDecisionSplit splitDecision = "split"
	// splitDecisionCached: its decode pod holds too much of the prompt
	// (fewer than nonCachedTokens uncached there).
	splitDecisionCached splitDecision = "cached"
	// splitDecisionShort: a prompt shorter than promptTokens (or than
	// nonCachedTokens).
	splitDecisionShort splitDecision = "short"
	// splitDecisionNoPrefillPod: no ready prefill pod free to prefill it.
	splitDecisionNoPrefillPod splitDecision = "no_prefill_pod"
	// splitDecisionLocalCheaper: prefilling on the decode pod gives the
	// earlier first token.
	splitDecisionLocalCheaper splitDecision = "local_cheaper"
)
