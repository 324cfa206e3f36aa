from mdcli.cli.app import main

main()
