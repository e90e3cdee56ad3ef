import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** An error answer of the RaPyDLI REST API (its JSON `error` text and HTTP status). */
export class APIError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
    this.name = 'APIError';
  }
}

/**
 * Call the RaPyDLI REST API (`/rapydli/api/<endPoint>`) and return its JSON answer.
 *
 * Throws an `APIError` carrying the server's `{"error": ...}` text on a non-2xx answer.
 */
export async function requestAPI<T>(
  endPoint = '',
  init: RequestInit = {}
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'rapydli', 'api', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new APIError(0, `cannot reach the server: ${error}`);
  }
  const text = await response.text();
  let data: any = null;
  if (text.length > 0) {
    try {
      data = JSON.parse(text);
    } catch {
      data = null;
    }
  }
  if (!response.ok) {
    const message =
      (data && (data.error || data.message)) || text || response.statusText;
    throw new APIError(response.status, `${message} (HTTP ${response.status})`);
  }
  return data as T;
}

export interface ICluster {
  id: string;
  /** server: started from this panel; detached: `rapydli cluster start`; kernel: held by a kernel or script. */
  origin: 'server' | 'detached' | 'kernel';
  hosts: string[];
  launcher: string;
  n: number;
  engines_alive: number;
  state: string;
  error: string | null;
  /** Id for `rd.Cluster.attach(...)` in a notebook, while the cluster runs. */
  attach_id: string | null;
  created: number;
  options: Record<string, unknown>;
  /** The batch job holding the engines (slurm), also while it waits in the queue. */
  job?: IBatchJob | null;
}

export interface IBatchJob {
  id: string;
  state: string;
  reason: string;
  nodes: string;
}

/** Where every rank of a cluster stands (`GET clusters/<id>/where`). */
export interface IWhereReply {
  id: string;
  /** The ranks grouped by the line they stand on, as `%rapydli where` prints them. */
  text: string;
  ranks: { rank: number; host: string; where: string; error: string | null }[];
}

export interface IClustersReply {
  clusters: ICluster[];
}

export interface ILauncher {
  name: string;
  description: string;
  options: Record<string, { type: string; help: string }>;
  /** The options the Start dialog shows as fields, in order. */
  form: string[];
}

export interface IRun {
  id: string;
  kind: string;
  name: string;
  parent: string | null;
  params: Record<string, unknown>;
  status: string;
  error: string | null;
  seed: number | null;
  world_size: number;
  started: number;
  ended: number | null;
  duration: number | null;
  host: string;
  note?: string | null;
  tags?: string[];
  final: Record<string, number | null>;
}

export interface IArtifact {
  path: string;
  kind: string;
  time: number;
}

/** Code a run names: a notebook's source as recorded, or a module's function or class. */
export interface ISource {
  name: string;
  origin: 'module' | 'notebook';
  source: string;
  /** Modules only: the parameter naming it (model_fn, ...), its `module:qualname`, file and line. */
  role?: string;
  ref?: string;
  file?: string;
  line?: number;
}

/** A run's tracker run: its MLflow or online W&B page (`url`), or its folder on disk (`path`: TensorBoard's log dir, an offline W&B run). */
export interface ITrackerLink {
  tracker: string;
  id: string;
  url: string | null;
  path: string | null;
}

export interface IRunDetail extends IRun {
  hosts: string[];
  artifacts: IArtifact[];
  records: Record<string, { type: string; value: any }>;
  children: IRun[];
  sources: ISource[];
  trackers: ITrackerLink[];
}

export interface IRunsReply {
  runs: IRun[];
  total: number;
}

export interface IMetricRow {
  seq: number;
  step: number;
  name: string;
  value: number | null;
  time: number;
}

export interface IMetricsReply {
  run_id: string;
  status: string;
  metrics: IMetricRow[];
  cursor: number;
}

export interface ITrial extends IRun {
  /** The parameters the sampler chose for this trial. */
  sampled: Record<string, unknown>;
  /** The sweep's state of the trial (COMPLETE, PRUNED, FAIL, ...) or the run status. */
  state: string;
  /** The final value of the sweep's metric. */
  value: number | null;
  /** `[step, value]` of the sweep's metric as the pruner saw them. */
  intermediate: [number, number | null][];
  /** Why the pruner stopped it (PRUNED trials recorded with it), else null. */
  prune: IPruneDecision | null;
}

/** A pruner's decision: the report it pruned at and the bar that report missed. */
export interface IPruneDecision {
  pruner: string;
  metric: string;
  step: number;
  value: number | null;
  compared_to: number | null;
  /** The comparison in words (null when the pruner exposes none). */
  rule: string | null;
  /** "pruned at step S with M V: rule". */
  text: string;
}

export interface ISweepReply {
  sweep: IRun;
  metric: string | null;
  direction: string;
  trials: ITrial[];
  /** Optuna's parameter importance, or null (the reason is in `importance_basis`). */
  importance: Record<string, number> | null;
  importance_basis: string;
}

/** A run in the families list: itself, its tags, final metrics and how many children it has. */
export interface IFamilyRun extends IRun {
  tags: string[];
  n_children: number;
  /** Trials only: the sweep's state of the trial (COMPLETE, PRUNED, FAIL) and why it was pruned. */
  state?: string;
  prune?: IPruneDecision | null;
}

export interface IFamily extends IFamilyRun {
  children: IFamilyRun[];
}

export interface IFamiliesReply {
  families: IFamily[];
  total: number;
  limit: number;
  offset: number;
}

export interface ICurvePoint {
  step: number;
  /** Seconds since the run started. */
  time: number;
  value: number | null;
}

export interface ICompareReply {
  runs: (IRun & { tags: string[] })[];
  /** Dotted parameter names shown (those that differ). */
  params: string[];
  values: Record<string, Record<string, unknown>>;
  differ: string[];
  metrics: string[];
  curves: Record<string, Record<string, ICurvePoint[]>>;
}

export interface IBatchItem extends IRun {
  parameters: Record<string, unknown>;
  notebook: string | null;
  failing_cell: string | null;
}

export interface IBatchReply {
  batch: IRun;
  items: IBatchItem[];
  artifacts: IArtifact[];
}

export interface IAnnotations {
  id: string;
  tags: string[];
  note: string | null;
}
