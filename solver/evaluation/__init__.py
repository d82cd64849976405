"""The evaluation, beside the pipeline. Takes plans, the paper's reported numbers
(`solver/data/paper_results.yaml`) and the vendored Vidur profiling data; gives the paper's
comparison and what explains it, Helix and Fig. 1a/1b (`coral bench paper`, `explain`, `helix`,
`figures`, `fig1a`), and our simulator and capacity model beside Vidur (`scripts/bench_vidur`).

`scenarios`: the paper's Sec. 6 scenarios as stacks, a method planned as `coral plan` plans;
`paper_comparison`: the table; `relaxation`: the cost without whole instances;
`paper_explain`: the probes behind the differences; `paper_helix`: Sec. 6.6;
`paper_figures`: Fig. 1a and 1b; `paper_results`: the paper's numbers, typed.
"""
