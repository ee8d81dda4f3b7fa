"""python -m tfdist.launch: start one job's tasks.

    python -m tfdist.launch --num_workers 2 [--devices_per_worker 2] -- scripts/train_xc.py ...
    python -m tfdist.launch --hosts host1,host2 --print -- scripts/train_xc.py ...
    python -m tfdist.launch --tpu NAME [--tpu_zone Z --gcp_project P] -- my_tpu_program.py ...

Local: N processes on loopback, free ports, a TF_CONFIG each, output
prefixed `[worker i]`, exit status of the first task that fails (the others
are ended). `--print`: the exact commands to start the same job on real hosts
(TF_CONFIG per host, and the equivalent `horovodrun` line). `--tpu`: the
program once, as the single controller of the TPU, with `TFDIST_TPU*` set
for `get_strategy("tpu", mesh_shape="data:N")` (pure data parallelism, one
replica per core; the scripts in scripts/ have no TPU strategy).
"""

import argparse
import os
import subprocess
import sys

from tfdist.launch.local import cluster_commands, horovod_command, run_local


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tfdist.launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_workers", type=int, default=2, help="Local tasks.")
    parser.add_argument("--devices_per_worker", type=int, default=1,
                        help="Logical CPU devices per task.")
    parser.add_argument("--pin_cores", action="store_true", help="Pin task i to core i.")
    parser.add_argument("--hosts", default="", help="Comma-separated hosts (with --print).")
    parser.add_argument("--port", type=int, default=2222, help="Port on each host.")
    parser.add_argument("--print", action="store_true", dest="print_only",
                        help="Print the commands for --hosts instead of running.")
    parser.add_argument("--tpu", default=None, help="TPU name or grpc:// address.")
    parser.add_argument("--tpu_zone", default="", help="GCP zone of the TPU.")
    parser.add_argument("--gcp_project", default="", help="GCP project of the TPU.")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the script and its flags.")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the program after `--`, e.g. -- scripts/train_xc.py --steps=10")
    if command[0].endswith(".py"):
        command = [sys.executable] + command
    for name in ("num_workers", "devices_per_worker"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer; received {getattr(args, name)}")
    if args.print_only and not args.hosts:
        parser.error("--print needs --hosts host1,host2,...")
    if args.tpu is not None and (args.hosts or args.num_workers != 2 and "--num_workers" in argv):
        parser.error("--tpu runs one controller for the whole TPU: drop --hosts/--num_workers")
    if (args.tpu_zone or args.gcp_project) and args.tpu is None:
        parser.error("--tpu_zone/--gcp_project need --tpu NAME")
    if args.hosts and not args.print_only:
        parser.error("--hosts starts nothing by itself: add --print and run the printed "
                     "commands on those hosts")
    return args, command


def main(argv=None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    if args.print_only:
        hosts = [h for h in args.hosts.split(",") if h]
        print("\n".join(cluster_commands(command, hosts, args.port, args.devices_per_worker)))
        print("# or, one process per device with Horovod:")
        print(horovod_command(command, hosts, args.devices_per_worker))
        return 0
    if args.tpu is not None:
        from tfdist.launch.tpu import tpu_env

        env = dict(os.environ, **tpu_env(args.tpu, args.tpu_zone, args.gcp_project))
        return subprocess.call(command, env=env)
    return run_local(command, args.num_workers, args.devices_per_worker, args.pin_cores)


if __name__ == "__main__":
    sys.exit(main())
