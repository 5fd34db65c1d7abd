"""The studies, one module each; importing a module registers its study (``studies.contract.register``).

sqrt_n                 Theorems 3.3 / 4.3 and Proposition 3.4: the sqrt(n) regime
mean_field             Theorem 3.5 and Proposition 3.6: the mean-field regime and the transition in n
large_radius           Theorems 3.7 / 4.5: the limit at large radius
masked                 Definition 2.6, Theorem 4.4 as stated (fails): masked measures, conditional W2
mass_splitting         split vs unsplit weighted constants
discrete_vs_meanfield  Lemma 3.2 and convergence in n
kernel_paths           the attention kernel's fused and streamed paths against the dense kernel
l2_attention           dot-product vs L2 attention (Kim et al. 2021)
dynamics               token dynamics: Transformers as PDEs
real_models            BERT and GPT-2 attention layers on real text
worst_case             certified worst-case inputs: a bracket on Lip(f on B_R^n) between the bounds
"""
