// Command firecracker is fcfake as a drop-in for the firecracker binary: it takes
// firecracker's command line (unknown arguments are refused, as firecracker does), binds
// the API socket (--api-sock, default /run/firecracker.socket) and serves the emulated API
// until killed. Its configuration (emulated version, the unix socket the guest's vsock
// listener is bridged to, where to record calls) comes from fcfake.Config; when started by
// the fake jailer it also gets the emulated chroot and the jailed uid and gid.
package main

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/internal/runtime/firecracker/fcfake"
)

// exitArgParsing is firecracker's exit code for a bad command line.
const exitArgParsing = 153

// argSpec lists firecracker's arguments: true for those taking a value.
func argSpec() map[string]bool {
	return map[string]bool{
		"api-sock": true, "id": true, "seccomp-filter": true, "no-seccomp": false,
		"start-time-us": true, "start-time-cpu-us": true, "parent-cpu-time-us": true,
		"config-file": true, "no-api": false, "log-path": true, "level": true, "module": true,
		"show-level": false, "show-log-origin": false, "metrics-path": true, "boot-timer": false,
		"version": false, "help": false, "snapshot-version": false, "describe-snapshot": true,
		"http-api-max-payload-size": true, "mmds-size-limit": true, "metadata": true,
		"enable-pci": false,
	}
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(argv []string) int {
	log := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelDebug}))
	args, err := parseArgs(argv)
	if err != nil {
		fmt.Printf("Arguments parsing error: %v \n\nFor more information try --help.\n", err)
		return exitArgParsing
	}
	cfg, cfgPath, err := fcfake.LoadConfig()
	if err != nil {
		fmt.Println("fcfake:", err)
		return 1
	}
	if _, ok := args["version"]; ok {
		fmt.Printf("Firecracker v%s\n\nSupported snapshot data format versions: (emulated)\n", cfg.Version)
		return 0
	}
	if _, ok := args["no-api"]; ok {
		fmt.Println("fcfake: --no-api is not emulated")
		return 1
	}
	opts := fcfake.Options{Version: cfg.Version, ID: args["id"], Root: os.Getenv(fcfake.EnvRoot), Logger: log}
	if opts.Root != "" {
		opts.CheckAccess = true
		if opts.UID, err = strconv.Atoi(os.Getenv(fcfake.EnvUID)); err == nil {
			opts.GID, err = strconv.Atoi(os.Getenv(fcfake.EnvGID))
		}
		if err != nil {
			fmt.Println("fcfake: jailed without a valid uid/gid:", err)
			return 1
		}
	}
	if cfg.AgentSocket != "" {
		opts.Guest = fcfake.DialUnixGuest(cfg.AgentSocket)
	}
	if cfg.BootDelay != "" {
		opts.BootDelay, _ = time.ParseDuration(cfg.BootDelay) // checked by LoadConfig
	}
	if cfg.Record != "" {
		opts.Record = func(c fcfake.Call) {
			if err := fcfake.AppendJSONLine(cfg.Record, c); err != nil {
				log.Error("record call", "err", err)
			}
		}
	}
	opts.OnLoadFailure = func() {
		log.Error("snapshot load failed: exiting, as firecracker does")
		os.Exit(1)
	}
	srv, err := fcfake.New(opts)
	if err != nil {
		fmt.Println("fcfake:", err)
		return 1
	}
	sock := args["api-sock"]
	if sock == "" {
		sock = "/run/firecracker.socket"
	}
	ln, err := srv.Listen(sock)
	if err != nil {
		log.Error("Failed to bind the API socket", "err", err)
		return 1
	}
	log.Info("fcfake firecracker running", "version", cfg.Version, "id", opts.ID, "api_sock", sock,
		"root", opts.Root, "config", cfgPath)
	if err := srv.Serve(ln); err != nil {
		log.Error("serve", "err", err)
		return 1
	}
	_ = srv.Close()
	return 0
}

// parseArgs parses firecracker's "--name value" and "--name=value" arguments strictly.
func parseArgs(argv []string) (map[string]string, error) {
	spec := argSpec()
	out := map[string]string{}
	for i := 0; i < len(argv); i++ {
		a := argv[i]
		name, val, hasVal := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		takes, known := spec[name]
		if !strings.HasPrefix(a, "--") || !known {
			return nil, fmt.Errorf("Found argument '%s' which wasn't expected, or isn't valid in this context.", a)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("The argument '%s' was provided more than once.", name)
		}
		switch {
		case takes && !hasVal:
			if i+1 >= len(argv) {
				return nil, fmt.Errorf("The argument '%s' requires a value, but none was supplied.", name)
			}
			i++
			val = argv[i]
		case !takes && hasVal:
			return nil, fmt.Errorf("The argument '%s' does not take a value.", name)
		}
		out[name] = val
	}
	return out, nil
}
