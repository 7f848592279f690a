from megatron_gspo.study import main

main()
