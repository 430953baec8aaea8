// Command space-agent is the in-sandbox agent: PID 1 of every sandbox. It reads its
// configuration from the environment and runs package agent until SIGTERM.
//
//	SPACE_AGENT_LISTEN         connect:/run/space/node.sock (gVisor: connect to the node), unix:/run/space/agent.sock (default: listen), vsock:PORT (Firecracker), serial:DEV (QEMU)
//	SPACE_AGENT_RUN_DIR        where the host drops the resume file (default: the socket's directory)
//	SPACE_AGENT_JOURNAL_BYTES  output journal bound per process, bytes (default 8388608)
//	SPACE_AGENT_RETENTION      how long exited processes stay readable (Go duration, default 10m)
//	SPACE_AGENT_MAX_EXITED     how many exited processes are retained (default 256)
//	SPACE_AGENT_STDIN_STALL    give up a stdin write the process does not read for this long (default 30s)
//	SPACE_AGENT_READER_STALL   a following reader behind for this long without reading stops holding its process's output back (default 1s; 0: never hold it back)
//	SPACE_AGENT_LOG_LEVEL      debug, info (default), warn, error
//	SPACE_AGENT_ETC_DIR        where the passwd and group files are read (default /etc)
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/agent"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	agent.MaybeRunGate() // must come first: gated processes re-execute this binary
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "space-agent:", err)
		os.Exit(1)
	}
}

func run() error {
	var level slog.Level
	if s := os.Getenv("SPACE_AGENT_LOG_LEVEL"); s != "" {
		if err := level.UnmarshalText([]byte(s)); err != nil {
			return fmt.Errorf("SPACE_AGENT_LOG_LEVEL: %w", err)
		}
	}
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: level}))

	cfg := agent.Config{
		Listen:  os.Getenv("SPACE_AGENT_LISTEN"),
		RunDir:  os.Getenv("SPACE_AGENT_RUN_DIR"),
		EtcDir:  os.Getenv("SPACE_AGENT_ETC_DIR"),
		Version: version,
		Logger:  log,
	}
	if os.Getpid() == 1 {
		cfg.CgroupRoot = "/sys/fs/cgroup" // the sandbox's own; user processes get a child
		cfg.RunTree = "/run"
	}
	var err error
	if cfg.JournalBytes, err = envInt("SPACE_AGENT_JOURNAL_BYTES"); err != nil {
		return err
	}
	if cfg.MaxExited, err = envInt("SPACE_AGENT_MAX_EXITED"); err != nil {
		return err
	}
	for name, dst := range map[string]*time.Duration{
		"SPACE_AGENT_RETENTION":    &cfg.Retention,
		"SPACE_AGENT_STDIN_STALL":  &cfg.StdinStallTimeout,
		"SPACE_AGENT_READER_STALL": &cfg.ReaderStall,
	} {
		if s := os.Getenv(name); s != "" {
			if *dst, err = time.ParseDuration(s); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
	}
	if s := os.Getenv("SPACE_AGENT_READER_STALL"); s != "" && cfg.ReaderStall <= 0 {
		cfg.ReaderStall = -1 // 0 turns waiting for readers off (the Config's zero is the default)
	}

	ctx, stop := signal.NotifyContext(context.Background(), unix.SIGTERM, unix.SIGINT)
	defer stop()
	reaper, err := agent.NewReaper(agent.ReaperConfig{Logger: log})
	if err != nil {
		return err
	}
	defer reaper.Close()
	cfg.Reaper = reaper
	a, err := agent.New(cfg)
	if err != nil {
		return err
	}
	log.Info("space-agent starting", "version", version, "pid", os.Getpid())
	return a.Run(ctx)
}

func envInt(name string) (int, error) {
	s := os.Getenv(name)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s: bad number %q", name, s)
	}
	return n, nil
}
