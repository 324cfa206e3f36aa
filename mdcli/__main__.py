from mdcli.cli import main

main()
