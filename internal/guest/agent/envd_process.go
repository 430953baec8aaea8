package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	processpb "github.com/spacedev/space/internal/guest/envdpb/process"
	"github.com/spacedev/space/internal/guest/wire"
)

// envdProcess implements envd's process.Process on the agent's processes.
//
// Semantics follow envd: Start's Connect-Timeout-Ms is the process's lifetime (it is
// killed when it passes); a client that goes away does not kill the process;
// Connect re-attaches to live output only (the SDKs keep what they received
// before); List shows running processes.
type envdProcess struct {
	e *envd
}

func (s *envdProcess) lookup(sel *processpb.ProcessSelector) (*process, error) {
	a := s.e.a
	a.procMu.Lock()
	defer a.procMu.Unlock()
	switch v := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		if p := a.procs[int(v.Pid)]; p != nil {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *processpb.ProcessSelector_Tag:
		var found *process
		for _, p := range a.procs {
			if p.spec.Tag == v.Tag && (found == nil || p.seq > found.seq) {
				found = p
			}
		}
		if found != nil {
			return found, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %q not found", v.Tag))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector (pid or tag) is required"))
}

// lookupLive is lookup for operations on a running process: an exited one is not
// found, as in envd.
func (s *envdProcess) lookupLive(sel *processpb.ProcessSelector) (*process, error) {
	p, err := s.lookup(sel)
	if err != nil {
		return nil, err
	}
	if _, done := p.exitInfo(); done {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %d has exited", p.pid))
	}
	return p, nil
}

func (s *envdProcess) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	a := s.e.a
	a.procMu.Lock()
	ps := make([]*process, 0, len(a.procs))
	for _, p := range a.procs {
		ps = append(ps, p)
	}
	a.procMu.Unlock()
	sort.Slice(ps, func(i, j int) bool { return ps[i].seq < ps[j].seq })
	out := &processpb.ListResponse{Processes: []*processpb.ProcessInfo{}}
	for _, p := range ps {
		if _, done := p.exitInfo(); done {
			continue
		}
		cwd := p.cwd
		info := &processpb.ProcessInfo{
			Pid:    uint32(p.pid),
			Config: &processpb.ProcessConfig{Cmd: p.spec.Argv[0], Args: p.spec.Argv[1:], Envs: p.spec.Env, Cwd: &cwd},
		}
		if p.spec.Tag != "" {
			tag := p.spec.Tag
			info.Tag = &tag
		}
		if info.Config.Envs == nil {
			info.Config.Envs = map[string]string{}
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

func (s *envdProcess) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	acct, err := s.e.rpcAccount(req.Header())
	if err != nil {
		return err
	}
	cfg := req.Msg.GetProcess()
	if cfg == nil || cfg.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	spec := wire.ProcessSpec{
		Argv:  append([]string{cfg.GetCmd()}, cfg.GetArgs()...),
		Env:   cfg.GetEnvs(),
		Cwd:   cfg.GetCwd(),
		User:  acct.Name,
		Stdin: req.Msg.Stdin == nil || req.Msg.GetStdin(),
		Tag:   req.Msg.GetTag(),
	}
	if req.Msg.Pty != nil {
		size := req.Msg.GetPty().GetSize()
		rows, cols := size.GetRows(), size.GetCols()
		if rows == 0 || cols == 0 {
			rows, cols = 24, 80
		}
		if rows > 0xffff || cols > 0xffff {
			return connect.NewError(connect.CodeInvalidArgument, errors.New("pty size is too large"))
		}
		spec.PTY = &wire.Size{Rows: uint16(rows), Cols: uint16(cols)}
		spec.Stdin = true
	}
	if deadline, ok := ctx.Deadline(); ok {
		// Connect-Timeout-Ms is the process's lifetime (envd semantics).
		spec.TimeoutMs = max(time.Until(deadline).Milliseconds(), 1)
	}
	p, f, err := s.e.a.startProcess(spec, true)
	if err != nil {
		return rpcError(err)
	}
	return s.follow(ctx, p, f, keepaliveInterval(req.Header()), func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.StartResponse{Event: ev})
	})
}

func (s *envdProcess) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	p, err := s.lookup(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	_, end := p.journal.bounds()
	return s.follow(ctx, p, p.journal.follow(end), keepaliveInterval(req.Header()), func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.ConnectResponse{Event: ev})
	})
}

// follow sends the start event, the process's output from follower f's offset, and
// its end event; keepalive events when nothing was sent for the interval. It closes f.
func (s *envdProcess) follow(ctx context.Context, p *process, f *follower, keepalive time.Duration,
	send func(*processpb.ProcessEvent) error) error {
	defer f.close()
	start := &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: uint32(p.pid)}}}
	if err := send(start); err != nil {
		return err
	}
	pty := p.spec.PTY != nil
	buf := make([]byte, 64<<10)
	pos := f.pos
	ka := time.NewTimer(keepalive)
	defer ka.Stop()
	for {
		changed := p.journal.changed()
		sent := false
		for {
			stream, n, gap := f.readAt(pos, buf)
			if gap > 0 {
				pos += gap // fell behind the journal's bound: those bytes are gone
				continue
			}
			if n == 0 {
				break
			}
			data := &processpb.ProcessEvent_DataEvent{}
			switch {
			case pty:
				data.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: buf[:n]}
			case stream == wire.FrameStderr:
				data.Output = &processpb.ProcessEvent_DataEvent_Stderr{Stderr: buf[:n]}
			default:
				data.Output = &processpb.ProcessEvent_DataEvent_Stdout{Stdout: buf[:n]}
			}
			if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: data}}); err != nil {
				return err
			}
			pos += int64(n)
			sent = true
		}
		if exit, done := p.exitInfo(); done {
			if _, end := p.journal.bounds(); pos >= end {
				if exit.TimedOut {
					// Killed for its Connect-Timeout-Ms: the deadline the client set.
					return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process %d: timeout reached, process killed", p.pid))
				}
				return send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: endEvent(exit)}})
			}
			continue // output arrived meanwhile: send it first
		}
		if sent {
			ka.Reset(keepalive)
		}
		select {
		case <-changed:
		case <-ctx.Done():
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("process %d: timeout reached", p.pid))
			}
			return connect.NewError(connect.CodeCanceled, ctx.Err())
		case <-ka.C:
			if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
			ka.Reset(keepalive)
		}
	}
}

// endEvent describes an exit like Go's os.ProcessState does in envd: "exit status N"
// (exited), "signal: killed" (exit code -1); error is set unless the exit code is 0.
func endEvent(exit wire.Exit) *processpb.ProcessEvent_EndEvent {
	end := &processpb.ProcessEvent_EndEvent{ExitCode: -1}
	switch {
	case exit.ExitCode != nil:
		end.ExitCode = int32(*exit.ExitCode)
		end.Exited = true
		end.Status = fmt.Sprintf("exit status %d", *exit.ExitCode)
	case exit.Signal != "":
		end.Status = "signal: " + unix.SignalNum(exit.Signal).String()
	default:
		end.Status = "unknown"
	}
	if exit.Error != "" {
		msg := exit.Error
		end.Error = &msg
	} else if end.ExitCode != 0 {
		msg := end.Status
		end.Error = &msg
	}
	return end
}

func (s *envdProcess) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	p, err := s.lookupLive(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if req.Msg.Pty != nil {
		size := req.Msg.GetPty().GetSize()
		if size.GetRows() == 0 || size.GetCols() == 0 || size.GetRows() > 0xffff || size.GetCols() > 0xffff {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("pty rows and cols must be between 1 and 65535"))
		}
		if err := p.resize(wire.Size{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())}); err != nil {
			return nil, rpcError(err)
		}
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

// input writes one SendInput/StreamInput payload to the process.
func (s *envdProcess) input(ctx context.Context, p *process, in *processpb.ProcessInput) error {
	var data []byte
	switch v := in.GetInput().(type) {
	case *processpb.ProcessInput_Stdin:
		if p.spec.PTY != nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has a terminal: send pty input", p.pid))
		}
		data = v.Stdin
	case *processpb.ProcessInput_Pty:
		if p.spec.PTY == nil {
			return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no terminal: send stdin", p.pid))
		}
		data = v.Pty
	default:
		return connect.NewError(connect.CodeInvalidArgument, errors.New("input (stdin or pty) is required"))
	}
	return rpcError(p.writeStdin(ctx, bytes.NewReader(data), false))
}

func (s *envdProcess) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	p, err := s.lookupLive(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := s.input(ctx, p, req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (s *envdProcess) StreamInput(ctx context.Context, stream *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	var p *process
	for stream.Receive() {
		switch ev := stream.Msg().GetEvent().(type) {
		case *processpb.StreamInputRequest_Start:
			found, err := s.lookupLive(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = found
		case *processpb.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("the first message must be a start event"))
			}
			if err := s.input(ctx, p, ev.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.StreamInputResponse{}), nil
}

func (s *envdProcess) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	var sig unix.Signal
	switch req.Msg.GetSignal() {
	case processpb.Signal_SIGNAL_SIGKILL:
		sig = unix.SIGKILL
	case processpb.Signal_SIGNAL_SIGTERM:
		sig = unix.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %v", req.Msg.GetSignal()))
	}
	p, err := s.lookupLive(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.signal(sig); err != nil {
		if _, code := classify(err); code == wire.ErrCodeConflict {
			return nil, connect.NewError(connect.CodeNotFound, err) // exited meanwhile
		}
		return nil, rpcError(err)
	}
	return connect.NewResponse(&processpb.SendSignalResponse{}), nil
}

func (s *envdProcess) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	p, err := s.lookupLive(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if p.spec.PTY != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has a terminal; its stdin cannot be closed", p.pid))
	}
	if err := p.writeStdin(ctx, bytes.NewReader(nil), true); err != nil {
		return nil, rpcError(err)
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}
