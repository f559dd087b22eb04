{{/* Full name of the release's objects. */}}
{{- define "phasesplit.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pod. The operator renders NetworkPolicies that admit its
metric scrapes from pods labelled app.kubernetes.io/name=phasesplit, component=operator. */}}
{{- define "phasesplit.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "phasesplit.labels" -}}
{{ include "phasesplit.selectorLabels" . }}
app.kubernetes.io/part-of: phasesplit
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "phasesplit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "phasesplit.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}
