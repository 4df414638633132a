"""The built-in policies, one module each (`paper`, `cause`): each lists its `Policy` classes in `POLICIES`, found by
`gnmr_hf.policy.get_policy` the first time a policy is looked up. The seam they fill in is `gnmr_hf.policy`."""
