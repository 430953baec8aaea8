package template

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
)

// maxLogLine bounds one build log line; longer output lines are split.
const maxLogLine = 4096

// runSteps starts a build sandbox on rootfs and runs the spec's steps in it, in order.
// The sandbox is stopped before runSteps returns, whatever happens.
func (b *Builder) runSteps(ctx context.Context, spec *Spec, cfg Config, rootfs string, start SandboxStarter, progress func(string)) (err error) {
	progress(fmt.Sprintf("starting the build sandbox for %d steps", len(spec.Steps)))
	sb, err := start(ctx, rootfs, cfg)
	if err != nil {
		return fmt.Errorf("template: start build sandbox: %w", err)
	}
	closed := false
	defer func() {
		if !closed {
			if cerr := sb.Close(context.WithoutCancel(ctx)); cerr != nil {
				b.logger().WarnContext(ctx, "template: stop build sandbox", "err", cerr)
			}
		}
	}()
	ag := sb.Agent()
	for i, st := range spec.Steps {
		if err := ctx.Err(); err != nil {
			return err
		}
		var serr error
		var what string
		if st.Run != nil {
			what = "run: " + shorten(st.Run.String(), 200)
			progress(fmt.Sprintf("step %d/%d: %s", i+1, len(spec.Steps), what))
			serr = runCommand(ctx, ag, st, cfg, progress)
		} else {
			what = fmt.Sprintf("copy: %s -> %s", st.Copy.Src, st.Copy.Dst)
			progress(fmt.Sprintf("step %d/%d: %s", i+1, len(spec.Steps), what))
			serr = b.copyIn(ctx, ag, st.Copy, progress)
		}
		if serr != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return &StepError{Index: i, Step: what, Err: serr}
		}
	}
	closed = true
	if err := sb.Close(ctx); err != nil {
		return fmt.Errorf("template: stop build sandbox: %w", err)
	}
	return nil
}

func shorten(s string, n int) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// runCommand runs a run step and streams its output into the log. A non-zero exit, a
// signal, a timeout or a program that cannot be executed is an error.
func runCommand(ctx context.Context, ag *agentclient.Client, st Step, cfg Config, progress func(string)) error {
	env := map[string]string{}
	for k, v := range cfg.Env {
		env[k] = v
	}
	for k, v := range st.Env {
		env[k] = v
	}
	timeout := time.Duration(st.Timeout)
	if timeout == 0 {
		timeout = DefaultStepTimeout
	}
	pi, err := ag.StartProcess(ctx, wire.ProcessSpec{
		Argv: st.Run.Args(), Env: env, Cwd: st.Workdir, User: st.User, TimeoutMs: timeout.Milliseconds(),
	})
	if err != nil {
		var ae *agentclient.Error
		if errors.As(err, &ae) {
			return errors.New(ae.Message)
		}
		return err
	}
	out, err := ag.Output(ctx, pi.PID, 0, true)
	if err != nil {
		return fmt.Errorf("read output: %w", err)
	}
	defer out.Close()
	stdout, stderr := &lineWriter{emit: progress}, &lineWriter{emit: progress}
	for {
		f, err := out.Next()
		if errors.Is(err, io.EOF) {
			return errors.New("the output stream ended before the command exited")
		}
		if err != nil {
			return fmt.Errorf("read output: %w", err)
		}
		switch f.Type {
		case wire.FrameStdout:
			stdout.write(f.Payload)
		case wire.FrameStderr:
			stderr.write(f.Payload)
		case wire.FrameGap:
			progress("[output lost: the command wrote faster than it could be logged]")
		case wire.FrameExit:
			stdout.flush()
			stderr.flush()
			var x wire.Exit
			if err := json.Unmarshal(f.Payload, &x); err != nil {
				return fmt.Errorf("decode exit: %w", err)
			}
			return exitError(x, timeout)
		}
	}
}

func exitError(x wire.Exit, timeout time.Duration) error {
	switch {
	case x.TimedOut:
		return fmt.Errorf("timed out after %s", timeout)
	case x.Error != "":
		return errors.New(x.Error)
	case x.Signal != "":
		return fmt.Errorf("killed by signal %s", x.Signal)
	case x.ExitCode != nil && *x.ExitCode != 0:
		return fmt.Errorf("exited with code %d", *x.ExitCode)
	}
	return nil
}

// lineWriter splits a byte stream into log lines.
type lineWriter struct {
	buf  []byte
	emit func(string)
}

func (w *lineWriter) write(p []byte) {
	w.buf = append(w.buf, p...)
	for {
		i := bytes.IndexByte(w.buf, '\n')
		if i < 0 {
			break
		}
		w.line(w.buf[:i])
		w.buf = w.buf[i+1:]
	}
	for len(w.buf) >= maxLogLine {
		w.line(w.buf[:maxLogLine])
		w.buf = w.buf[maxLogLine:]
	}
	w.buf = append([]byte(nil), w.buf...)
}

func (w *lineWriter) line(b []byte) {
	w.emit(strings.ToValidUTF8(strings.TrimSuffix(string(b), "\r"), "\uFFFD"))
}

func (w *lineWriter) flush() {
	if len(w.buf) > 0 {
		w.line(w.buf)
		w.buf = nil
	}
}

// copyIn copies a file or directory from the node into the template through the
// build sandbox's agent, so that no destination path can lead outside the sandbox's
// root filesystem. Sources are read through an os.Root of the checked source, so
// symbolic links inside a copied tree cannot lead out of it either.
func (b *Builder) copyIn(ctx context.Context, ag *agentclient.Client, c *CopyStep, progress func(string)) error {
	src, err := b.Sources.CheckPath("copy.src", c.Src, true)
	if err != nil {
		return err
	}
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if !fi.IsDir() {
		dir, base := filepath.Split(src)
		root, err := os.OpenRoot(dir)
		if err != nil {
			return err
		}
		defer root.Close()
		dst := c.Dst
		if strings.HasSuffix(dst, "/") {
			dst = path.Join(dst, filepath.Base(c.Src))
		}
		n, err := copyFile(ctx, ag, root, base, dst, c)
		if err != nil {
			return err
		}
		progress(fmt.Sprintf("copied %s (%d bytes)", dst, n))
		return nil
	}
	root, err := os.OpenRoot(src)
	if err != nil {
		return err
	}
	defer root.Close()
	var files int
	var bytes int64
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		dst := path.Join(c.Dst, p)
		info, err := root.Lstat(p)
		if err != nil {
			return err
		}
		if info.Mode()&fs.ModeSymlink != 0 {
			// Follow the link inside the tree only: a link out of it is refused.
			if info, err = root.Stat(p); err != nil {
				return fmt.Errorf("%s: a symbolic link that leads out of the source or nowhere: %v", path.Join(src, p), err)
			}
			if info.IsDir() {
				progress(fmt.Sprintf("skipped %s: a symbolic link to a directory", path.Join(src, p)))
				return nil
			}
		}
		switch {
		case info.IsDir():
			_, err := ag.Mkdir(ctx, wire.MkdirRequest{Path: dst, User: c.User, Mode: uint32(info.Mode().Perm()), Parents: true})
			var ae *agentclient.Error
			if errors.As(err, &ae) && ae.Code == wire.ErrCodeExists {
				return nil
			}
			return err
		case info.Mode().IsRegular():
			n, err := copyFile(ctx, ag, root, p, dst, c)
			files++
			bytes += n
			return err
		default:
			progress(fmt.Sprintf("skipped %s: not a regular file or directory", path.Join(src, p)))
			return nil
		}
	})
	if err != nil {
		return err
	}
	progress(fmt.Sprintf("copied %d files (%.1f MiB) into %s", files, float64(bytes)/(1<<20), c.Dst))
	return nil
}

// copyFile writes one file of root into the sandbox at dst.
func copyFile(ctx context.Context, ag *agentclient.Client, root *os.Root, name, dst string, c *CopyStep) (int64, error) {
	f, err := root.Open(name)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("%s is not a regular file", name)
	}
	mode := uint32(fi.Mode().Perm())
	if c.Mode != nil {
		mode = uint32(*c.Mode)
	}
	if mode == 0 {
		mode = 0o644
	}
	info, err := ag.WriteFile(ctx, dst, f, agentclient.WriteOptions{User: c.User, Mode: mode})
	if err != nil {
		return 0, fmt.Errorf("write %s: %w", dst, err)
	}
	return info.Size, nil
}
